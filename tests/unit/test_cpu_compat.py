"""The Megatron CPU shim is applied only without CUDA, and then makes GPTModel run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_shim_not_applied_when_cuda_exists() -> None:
    out = _run(
        """
        import torch
        torch.cuda.is_available = lambda: True
        before = torch.cuda.current_device
        from dynarl.backends._cpu_compat import apply_cpu_shim, cpu_shim_applied
        print(apply_cpu_shim(), cpu_shim_applied(), torch.cuda.current_device is before)
        """
    )
    assert out == "False False True"


@pytest.mark.slow  # every Megatron test in make test runs GPT forward/backward on the shim
@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for CPU-only machines")
def test_shim_makes_gpt_forward_backward_run_on_cpu() -> None:
    out = _run(
        """
        import os
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        from dynarl.backends._cpu_compat import apply_cpu_shim
        assert apply_cpu_shim()
        import torch, torch.distributed as dist
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        from megatron.core import parallel_state
        from megatron.core.transformer import TransformerConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        parallel_state.initialize_model_parallel(1, 1)
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(123)  # the RNG tracker dropout forks
        cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
            ffn_hidden_size=128, use_cpu_initialization=True, params_dtype=torch.float32,
            hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
            masked_softmax_fusion=False, gradient_accumulation_fusion=False,
            apply_rope_fusion=False)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=128, max_sequence_length=32)
        tokens = torch.randint(0, 128, (2, 16))
        pos = torch.arange(16).expand(2, 16)
        # An explicit causal mask: Megatron's default one is built with device="cuda".
        mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
        loss = model(tokens, pos, mask, labels=tokens).mean()
        loss.backward()
        dist.destroy_process_group()
        print("ok", bool(torch.isfinite(loss)))
        """
    )
    assert out.endswith("ok True")
