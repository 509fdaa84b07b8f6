"""The Megatron-core trainer's weights into a real vLLM engine and an SGLang one (the fake)
at once (issue 19's weight path): a ``MegatronTrainer`` loaded from the vLLM engine's own HF
checkpoint, its weights perturbed, gathered, mapped to HF names and layouts and pushed by
:func:`push_to_engines` — to vLLM through dynarl's worker extension, to SGLang by its
update-from-distributed sequence with the engine's checksums verified.

The trainer runs in a spawned process (it initialises ``torch.distributed``, which must not
leak into the test process). Afterwards the engine's log-probs, sampled and scored, are
those of an HF model holding the trainer's weights (fp32 bound), every token reports the
version pushed, the fake SGLang engine (a process of its own: two weight-update groups of
one name cannot share a process) reports checksums equal to the pushed tensors' and that
version, and the original weights are pushed back for the tests that follow.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from migrate_ranks import run_ranks
from vllm_support import MAX_NUM_SEQS, greedy_request

from dynarl.backends.serving import ScoreRequest
from dynarl.backends.sglang import SGLangServer, SGLangServerConfig, SGLangServerEngine
from dynarl.backends.vllm import VLLMEngine, VLLMServer, WeightPusher

from .test_weight_push import LOGPROB_TOL, forward_logprobs, perturbed, teacher_forced

pytestmark = pytest.mark.engines

VERSION = "11"


def push_from_megatron(
    rank: int, world: int, port: int, url: str, sglang_url: str, model_dir: str
) -> Any:
    """One trainer rank: load the HF checkpoint, perturb, push as ``VERSION``; the HF
    tensors pushed (as numpy arrays)."""
    import torch.distributed as dist

    from dynarl.backends.megatron import (
        MegatronTrainConfig,
        MegatronTrainer,
        load_hf_checkpoint,
        model_config_from_hf,
    )
    from dynarl.backends.megatron._sync import EngineTarget, push_to_engines, to_hf

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=world
    )
    model = model_config_from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
    trainer = MegatronTrainer(model, MegatronTrainConfig(device="cpu"), rank=rank, store=store)
    trainer.start(trainer.layout_spec((0,)), epoch=0)
    load_hf_checkpoint(trainer, model_dir)
    trainer.load_full(perturbed(trainer.gather(0), seed=7))
    hf = to_hf(trainer.gather(0), model)
    # SGLang's side verifies the engine's /weights_checker checksums against these tensors.
    targets = [EngineTarget("vllm", url), EngineTarget("sglang", sglang_url)]
    asyncio.run(push_to_engines(trainer, targets, VERSION))
    trainer.close()
    dist.destroy_process_group()
    return {name: tensor.numpy().copy() for name, tensor in hf.items()}


async def weight_version_of(url: str) -> str:
    async with SGLangServerEngine(url=url) as engine:
        return str((await engine.client.model_info())["weight_version"])


def test_a_megatron_trainers_weights_reach_the_engines(
    vllm_server: VLLMServer, tiny_model: Path, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    original = safetensors.load_file(str(tiny_model / "model.safetensors"))
    weights = tmp_path / "engine.pt"
    torch.save(dict(original), weights)
    sglang = SGLangServer(
        SGLangServerConfig(
            model_path="fake-tiny-llama",
            module="dynarl.testing.sglang_fake",
            extra_args=("--fake-weights", str(weights)),
            startup_timeout_s=60,
        )
    )
    loop = asyncio.new_event_loop()  # the server's process is watched from the loop it began on
    try:
        loop.run_until_complete(sglang.start())
        (pushed,) = run_ranks(
            push_from_megatron, 1, vllm_server.url, sglang.url, str(tiny_model), timeout_s=240
        )
        sglang_version = loop.run_until_complete(weight_version_of(sglang.url))
    finally:
        loop.run_until_complete(sglang.aclose())
        loop.close()
    assert sglang_version == VERSION
    assert set(pushed) == set(original)
    state = {name: torch.from_numpy(array) for name, array in pushed.items()}
    assert any(not torch.equal(state[name], original[name]) for name in original)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    model.load_state_dict(state)
    model.eval()
    request = greedy_request("megatron-push", 24, seed=5)

    async def main() -> tuple[Any, tuple[float, ...]]:
        engine = VLLMEngine(url=vllm_server.url, max_num_seqs=MAX_NUM_SEQS)
        await engine.start()
        try:
            out = await engine.generate(request)
            sequence = request.token_ids + out.token_ids
            scores = await engine.score(ScoreRequest(request_id="mp", token_ids=sequence))
            async with WeightPusher([engine.client]) as pusher:  # the original, for later tests
                await pusher.push(original, "0")
        finally:
            await engine.aclose()
        return out, scores

    out, scores = asyncio.run(main())
    assert out.token_versions() == (VERSION,) * len(out.token_ids)
    expected = forward_logprobs(model, request.token_ids, out)
    assert list(out.logprobs) == pytest.approx(expected, abs=LOGPROB_TOL)
    full = teacher_forced(model, request.token_ids + out.token_ids)
    assert list(scores) == pytest.approx(full, abs=LOGPROB_TOL)
