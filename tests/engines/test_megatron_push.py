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
from dynarl.backends.vllm import (
    VLLMClient,
    VLLMClientConfig,
    VLLMEngine,
    VLLMServer,
    WeightPusher,
)

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


@pytest.mark.slow  # ~45 s on two cores beyond the shared servers; the job test below stays
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


def test_a_job_trains_with_the_megatron_role_and_pushes_to_its_rollout_engine(
    vllm_server: VLLMServer, tiny_model: Path, tmp_path: Path
) -> None:
    """The production job's loop, one step: a rollout on the real vLLM engine generates a
    group, the Megatron trainer role (loaded from the engine's own checkpoint) takes a GRPO
    step on it and pushes its weights to the engine the rollout names; the next generation
    reports the new version and differs."""
    from dynarl.backends.megatron import (
        MegatronSetup,
        MegatronTrainConfig,
        MegatronTrainerRole,
        engine_targets,
    )
    from dynarl.backends.serving import EngineRollout, EngineSetup
    from dynarl.bus import GenerationRequest, pack_tokens, unpack_floats
    from dynarl.runtime import VERSIONS as VERSION_KEY
    from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig, decode_versions
    from dynarl.sched import SchedulerConfig

    safetensors = pytest.importorskip("safetensors.torch")
    original = safetensors.load_file(str(tiny_model / "model.safetensors"))
    rollout = EngineSetup(urls={"0": vllm_server.url}, max_num_seqs=MAX_NUM_SEQS, ignore_eos=True)
    trainer = MegatronSetup.from_hf(
        tiny_model, train=MegatronTrainConfig(lr=3e-2, device="cpu"), num_threads=1
    )
    specs = [
        ComponentSpec(role=EngineRollout, devices=(0,), options=rollout.to_options()),
        ComponentSpec(role=MegatronTrainerRole, devices=(1,), options=trainer.to_options()),
    ]
    runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True))
    config = JobConfig(run_dir=str(tmp_path / "run"), runtime=runtime)
    prompt = pack_tokens(list(greedy_request("p", 1, seed=9).token_ids))

    def group(step: int) -> list[GenerationRequest]:
        return [
            GenerationRequest(
                sample_id=f"s{step}-{i}",
                token_ids=prompt,
                max_new_tokens=12,
                temperature=0.0,
                metadata={"group": 0, "seed_id": i, "advantage": 1.0 - i},
            )
            for i in range(2)
        ]

    async def generate(job: Job, step: int) -> list[Any]:
        job.submit("rollout", group(step))
        out = job.output("rollout")
        return [await out.get() for _ in range(2)]

    async def main() -> tuple[list[Any], list[Any]]:
        async with asyncio.timeout(600), Job(specs, config) as job:
            before = await generate(job, 0)
            await job.call("trainer", "train_step", before)
            addresses = await job.call("rollout", "engine_address")
            await job.call("trainer", "push_weights", engines=engine_targets(addresses), version=1)
            after = await generate(job, 1)
            client = VLLMClient(VLLMClientConfig(base_url=vllm_server.url))
            async with client, WeightPusher([client]) as pusher:
                await pusher.push(original, "0")  # the original, for later tests
            return before, after

    before, after = asyncio.run(main())
    assert all(decode_versions(str(s.metadata[VERSION_KEY])) == [0] * 12 for s in before)
    assert all(decode_versions(str(s.metadata[VERSION_KEY])) == [1] * 12 for s in after)
    assert list(unpack_floats(after[0].logprobs)) != list(unpack_floats(before[0].logprobs))
