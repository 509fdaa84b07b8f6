"""dynarl.backends.megatron in one process (a one-rank gloo job): configs, the model's
description, the HF name map against an independent HF-Llama forward, checkpoint formats,
and the CPU optimizer against plain torch."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import distributed_c10d as c10d

import dynarl.backends.megatron as megatron_backend
from dynarl.backends._grpo import TrainSample, pad_samples
from dynarl.backends.megatron import (
    GPTModelConfig,
    MegatronTrainConfig,
    MegatronTrainer,
    describe,
    export_hf_checkpoint,
    hf_config,
    load_hf_checkpoint,
    model_config_from_hf,
    read_hf_tensors,
    to_hf,
    write_hf_tensors,
)
from dynarl.backends.megatron._gpt_model import causal_inputs, token_logprobs
from dynarl.backends.reference import solo_process_group
from dynarl.migrate import LayoutSpec

# Megatron 0.16.1's RowParallelLinear does not pass its own group down and warns about it on
# rank 0 at every forward: third-party noise.
pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")

LLAMA = GPTModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=48, vocab_size=96, max_sequence_length=64, rotary_base=500.0,
    norm_epsilon=1e-6,
)  # fmt: skip
QWEN = GPTModelConfig(
    num_layers=1, hidden_size=24, num_attention_heads=6, num_query_groups=3,
    ffn_hidden_size=40, vocab_size=64, add_qkv_bias=True, tie_embeddings=True,
)  # fmt: skip
CPU = MegatronTrainConfig(lr=1e-2, micro_batch_size=2, device="cpu")


@pytest.fixture
def solo() -> Iterator[Any]:
    """A one-rank job and its store; every process group built in the test must be gone."""
    with solo_process_group():
        yield dist.HashStore()  # type: ignore[attr-defined]
    assert not c10d._world.pg_map, f"leaked process groups: {list(c10d._world.pg_names.values())}"


def trainer(
    store: Any, model: GPTModelConfig = LLAMA, config: MegatronTrainConfig = CPU
) -> MegatronTrainer:
    out = MegatronTrainer(model, config, rank=0, store=store)
    out.start(out.layout_spec((0,)), epoch=0)
    return out


def random_hf(
    model: GPTModelConfig, seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    meta = {s.name: torch.empty(s.shape, device="meta") for s in describe(model)}
    return {
        n: (torch.randn(t.shape, generator=gen) * 0.2).to(dtype)
        for n, t in to_hf(meta, model).items()
    }


def hf_llama_logits(
    w: dict[str, torch.Tensor], model: GPTModelConfig, tokens: torch.Tensor
) -> torch.Tensor:
    """Logits of HF's Llama/Qwen2 forward (rotate-half rope, GQA by repeat), written out."""
    b, s = tokens.shape
    nh, nkv, hd = model.num_attention_heads, model.query_groups, model.kv_channels
    inv = 1.0 / (model.rotary_base ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(torch.arange(s).float(), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

    def rot(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.norm_epsilon) * weight

    def proj(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))

    h = w["model.embed_tokens.weight"][tokens]
    mask = torch.full((s, s), float("-inf")).triu(1)
    for layer in range(model.num_layers):
        p = f"model.layers.{layer}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = proj(x, p + "self_attn.q_proj").view(b, s, nh, hd).transpose(1, 2)
        k = proj(x, p + "self_attn.k_proj").view(b, s, nkv, hd).transpose(1, 2)
        v = proj(x, p + "self_attn.v_proj").view(b, s, nkv, hd).transpose(1, 2)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        h = h + proj((att @ v).transpose(1, 2).reshape(b, s, nh * hd), p + "self_attn.o_proj")
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        h = h + proj(
            F.silu(proj(x, p + "mlp.gate_proj")) * proj(x, p + "mlp.up_proj"), p + "mlp.down_proj"
        )
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms(h, w["model.norm.weight"]) @ head.T


def test_configs_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="num_query_groups"):
        GPTModelConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=4,
            num_query_groups=3,
            ffn_hidden_size=8,
            vocab_size=8,
        )
    with pytest.raises(ValueError, match="params_dtype"):
        GPTModelConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=4,
            ffn_hidden_size=8,
            vocab_size=8,
            params_dtype="int8",
        )
    with pytest.raises(ValueError, match="micro_batch_size"):
        MegatronTrainConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match="clip_grad"):
        MegatronTrainConfig(clip_grad=0.0)


def test_description_is_cheap_complete_and_matches_a_built_model(solo: Any) -> None:
    specs = describe(LLAMA)
    by_name = {s.name: s for s in specs}
    assert by_name["decoder.layers.1.mlp.linear_fc1.weight"].shape == (96, 32)
    assert (
        by_name["decoder.layers.1.mlp.linear_fc1.weight"].tp_stride == 2
    )  # [gate_r; up_r] per rank
    assert by_name["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        (4 + 2 * 2) * 8,
        32,
    )
    assert by_name["output_layer.weight"].tp_dim == 0
    assert len(specs) == 2 + 6 * 2 + 1
    built = trainer(solo)
    try:
        from dynarl.migrate._megatron_layout import param_specs

        assert param_specs(built.module, tp=1) == specs
    finally:
        built.close()


def test_trainer_refuses_what_the_cpu_cannot_run(solo: Any) -> None:
    one = trainer(solo)
    try:
        with pytest.raises(ValueError, match="distributed optimizer"):
            one.layout_for(one.layout_spec((0,), distributed_optimizer=True))
        with pytest.raises(ValueError, match="dtypes"):
            one.layout_for(LayoutSpec(ranks=(0,), param_dtype="bfloat16", master_dtype="float32"))
    finally:
        one.close()
    bf16 = GPTModelConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        ffn_hidden_size=8,
        vocab_size=16,
        params_dtype="bfloat16",
    )
    with pytest.raises(ValueError, match="float32"):
        trainer(solo, bf16)


def test_distributed_optimizer_ranges_are_checked_against_megatrons(solo: Any) -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from test_megatron_buffer_ranges import StubGroup  # a DP group seen from one rank

    from dynarl.backends.megatron._gpt_model import pg_collection
    from dynarl.backends.megatron._instance import distributed_optimizer_mismatches
    from dynarl.migrate import trainer_layout
    from dynarl.migrate._megatron_layout import param_names

    one = trainer(solo)
    try:
        assert one.module is not None and one._current is not None
        # Megatron's own buffers and range map for data-parallel rank 1 of 2.
        groups = pg_collection(one._current.groups)
        for kind in ("dp", "dp_cp", "intra_dp_cp"):
            setattr(groups, kind, StubGroup(1, 2))
        ddp = DistributedDataParallel(
            config=one.module.config,
            ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
            module=one.module,
            pg_collection=groups,
        )
        names = {id(p): name for _, name, p in param_names(one.module)}
        (buckets,) = DistributedOptimizer._build_gbuf_range_map(ddp.buffers[0]).values()
        theirs = {
            names[id(p)]: (r["param"].start, r["param"].end)
            for bucket in buckets
            for p, r in bucket["param_map"].items()
        }
        assert 0 < len(theirs) < len(names)  # rank 1 owns part of the buffer
        layout = trainer_layout(
            one.specs, LayoutSpec(ranks=(5, 0), dp=2, distributed_optimizer=True)
        )
        assert distributed_optimizer_mismatches(one.module, layout, 0, theirs) == []
        name, (start, end) = next(iter(theirs.items()))
        bad = theirs | {name: (start, end - 1)}
        assert distributed_optimizer_mismatches(one.module, layout, 0, bad) == [
            f"{name}: optimizer {(start, end - 1)}, layout {(start, end)} {(end - start,)}"
        ]
    finally:
        one.close()


def test_trainer_needs_a_distributed_job() -> None:
    with pytest.raises(ValueError, match="initialised"):
        MegatronTrainer(LLAMA, CPU, rank=0, store=dist.HashStore())  # type: ignore[attr-defined]


@pytest.mark.parametrize("model", [LLAMA, QWEN], ids=["llama-gqa", "qwen2-bias-tied"])
@pytest.mark.gloo_listener_outlives_test
def test_loaded_hf_weights_compute_hf_llama_logits(
    solo: Any, tmp_path: pathlib.Path, model: GPTModelConfig
) -> None:
    weights = random_hf(model, seed=3)
    write_hf_tensors(tmp_path, weights, hf_config(model))
    assert ("lm_head.weight" in weights) != model.tie_embeddings
    one = trainer(solo, model)
    try:
        load_hf_checkpoint(one, tmp_path)
        tokens = torch.randint(
            0, model.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5)
        )
        with torch.no_grad():
            got = one.module(tokens, *causal_inputs(tokens))
        torch.testing.assert_close(
            got, hf_llama_logits(weights, model, tokens), rtol=1e-4, atol=1e-4
        )
    finally:
        one.close()


def shard_as_index(directory: pathlib.Path, tensors: dict[str, torch.Tensor], binary: bool) -> None:
    """Split ``tensors`` into two files listed by an index, as HF does for large models."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    halves = {f"part-{i}.{'bin' if binary else 'safetensors'}": names[i::2] for i in range(2)}
    for file, members in halves.items():
        part = {n: tensors[n].contiguous() for n in members}
        torch.save(part, directory / file) if binary else save_file(part, str(directory / file))
    index = {"metadata": {}, "weight_map": {n: f for f, ms in halves.items() for n in ms}}
    suffix = "pytorch_model.bin" if binary else "model.safetensors"
    (directory / f"{suffix}.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("form", ["safetensors", "bin", "safetensors-index", "bin-index"])
def test_checkpoint_files_read_back_bitwise_and_selectively(
    tmp_path: pathlib.Path, form: str
) -> None:
    weights = random_hf(LLAMA, seed=4, dtype=torch.bfloat16)
    if form.endswith("index"):
        shard_as_index(tmp_path, weights, binary=form.startswith("bin"))
    else:
        write_hf_tensors(tmp_path, weights, hf_config(LLAMA), safetensors=form == "safetensors")
    back = read_hf_tensors(tmp_path)
    assert set(back) == set(weights) and all(torch.equal(back[n], weights[n]) for n in weights)
    some = read_hf_tensors(tmp_path, ["model.norm.weight", "model.layers.1.mlp.up_proj.weight"])
    assert set(some) == {"model.norm.weight", "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="lacks"):
        read_hf_tensors(tmp_path, ["model.layers.9.mlp.up_proj.weight"])


def test_empty_directory_and_unsupported_configs_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        read_hf_tensors(tmp_path)
    base = hf_config(LLAMA)
    assert model_config_from_hf(base) == LLAMA
    assert model_config_from_hf(hf_config(QWEN)) == QWEN
    for change in (
        {"model_type": "mistral"},
        {"rope_scaling": {"factor": 8.0}},
        {"hidden_act": "gelu"},
        {"mlp_bias": True},
    ):
        with pytest.raises(ValueError):
            model_config_from_hf(base | change)


@pytest.mark.parametrize("model", [LLAMA, QWEN], ids=["llama-gqa", "qwen2-bias-tied"])
def test_bf16_checkpoint_round_trips_bitwise_through_an_fp32_trainer(
    solo: Any, tmp_path: pathlib.Path, model: GPTModelConfig
) -> None:
    weights = random_hf(model, seed=6, dtype=torch.bfloat16)
    config = hf_config(model) | {"torch_dtype": "bfloat16", "eos_token_id": 2}
    write_hf_tensors(tmp_path / "in", weights, config, safetensors=False)
    one = trainer(solo, model)
    try:
        load_hf_checkpoint(one, tmp_path / "in")
        export_hf_checkpoint(one, tmp_path / "out", base_config=config)
    finally:
        one.close()
    back = read_hf_tensors(tmp_path / "out")
    assert set(back) == set(weights)
    assert all(
        torch.equal(back[n].view(torch.int16), weights[n].view(torch.int16)) for n in weights
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == config


def test_loading_another_architecture_is_refused(solo: Any, tmp_path: pathlib.Path) -> None:
    write_hf_tensors(tmp_path, random_hf(QWEN, seed=1), hf_config(QWEN))
    one = trainer(solo)
    try:
        with pytest.raises(ValueError, match=r"config\.json describes"):
            load_hf_checkpoint(one, tmp_path)
    finally:
        one.close()


def samples(seed: int) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(5):
        tokens = torch.randint(0, LLAMA.vocab_size, (8 + i,), generator=gen).tolist()
        out.append(
            TrainSample(tokens=tuple(tokens), loss_mask=tuple([False] * 2 + [True] * (5 + i)))
        )
    return out


@pytest.mark.gloo_listener_outlives_test
def test_cpu_step_equals_plain_torch_adamw_with_clipping(solo: Any) -> None:
    config = MegatronTrainConfig(
        lr=1e-2, micro_batch_size=2, clip_grad=0.05, weight_decay=0.1, device="cpu"
    )
    one = trainer(solo, config=config)
    try:
        module = one.module
        assert module is not None
        plain = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
        batch = samples(1)
        stats = one.sft_step(batch)
        # The same step by hand: summed micro-batch losses, global norm, clip, AdamW.
        normalizer = sum(sum(s.loss_mask) for s in batch)
        for start in range(0, len(batch), 2):
            tokens, mask = pad_samples(batch[start : start + 2])
            # The same module, run on the copies of its parameters.
            logits = torch.func.functional_call(module, plain, (tokens, *causal_inputs(tokens)))
            (-(token_logprobs(logits, tokens, 1.0) * mask).sum() / normalizer).backward()
        norm = torch.sqrt(sum(p.grad.norm() ** 2 for p in plain.values()))
        assert stats.grad_norm == pytest.approx(float(norm), rel=1e-5) and float(norm) > 0.05
        decay = [p for p in plain.values() if p.dim() > 1]
        rest = [p for p in plain.values() if p.dim() == 1]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=1e-2,
            foreach=False,
        )
        for p in plain.values():
            p.grad.mul_(0.05 / (float(norm) + 1e-6))
        opt.step()
        for name, param in module.named_parameters():
            torch.testing.assert_close(param.detach(), plain[name].detach(), rtol=1e-6, atol=1e-7)
    finally:
        one.close()


def test_package_exports_are_sorted_and_complete() -> None:
    exported = megatron_backend.__all__
    assert exported == sorted(exported)
    for name in exported:
        assert hasattr(megatron_backend, name)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_megatron_optimizer_paths_reshard_bitwise_with_cuda_types_faked(dtype: str) -> None:
    """tests/megatron_fake_cuda.py in a subprocess (it patches torch process-wide)."""
    script = pathlib.Path(__file__).parent.parent / "megatron_fake_cuda.py"
    done = subprocess.run(
        [sys.executable, str(script), dtype],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["optimizer"] == "DistributedOptimizer"
    assert result["losses"][-1] < result["losses"][0]
    plain = "Float16OptimizerWithFloat16Params" if dtype == "bfloat16" else "FP32Optimizer"
    assert [m["optimizer"] for m in result["moves"]] == [plain, "DistributedOptimizer"]
    for move in result["moves"]:
        assert all(
            move[k] for k in ("ok", "checksum_kept", "restart_equal", "step_equal", "state_equal")
        ), move
