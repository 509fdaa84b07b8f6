"""The serving role reused for inference (marker ``dist``): a job whose rollout and
inference components both run :class:`~dynarl.backends.serving.EngineSetup` engines, one
generating (:class:`~dynarl.backends.serving.EngineRollout`) and one scoring what it
generated (:class:`~dynarl.backends.serving.EngineInference`).

Both launch the SGLang fake (``dynarl.testing.sglang_fake``, a real HTTP server in its own
process, fast to start) on their device. Each rollout sample sent to the inference
component comes back with the log-prob of every token after the first: over the response,
the log-probs it was sampled with; over the prompt, the fake model's own. The rollout's
``engine_address`` call names the server a trainer would push weights to. Bounded by
timeouts; no timing is asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import pytest

from dynarl.backends.serving import EngineInference, EngineRollout, EngineSetup
from dynarl.bus import GenerationRequest, Sample, pack_tokens, unpack_floats, unpack_tokens
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import SchedulerConfig
from dynarl.testing.sglang_fake._versions import token_logprob

pytestmark = pytest.mark.dist

NUM = 4


def setup(tmp_path: Path, name: str) -> EngineSetup:
    return EngineSetup(
        kind="sglang",
        model="fake-model",
        module="dynarl.testing.sglang_fake",
        log_dir=str(tmp_path / name),
        startup_timeout_s=60.0,
    )


async def collect(job: Job, component: str, num: int) -> dict[str, Sample]:
    out = job.output(component)
    got: dict[str, Sample] = {}
    while len(got) < num:
        sample = await out.get()
        assert sample.sample_id not in got, f"{sample.sample_id} delivered twice"
        got[sample.sample_id] = sample
    return got


def test_an_inference_component_scores_what_the_rollout_generated(tmp_path: Path) -> None:
    specs = [
        ComponentSpec(
            role=EngineRollout, devices=(0,), options=setup(tmp_path, "rollout").to_options()
        ),
        ComponentSpec(
            role=EngineInference, devices=(1,), options=setup(tmp_path, "scorer").to_options()
        ),
    ]
    runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True))
    config = JobConfig(run_dir=str(tmp_path / "run"), runtime=runtime)
    requests = [
        GenerationRequest(
            sample_id=f"s{i}", token_ids=pack_tokens([3, i, 5, 7]), max_new_tokens=10 + i
        )
        for i in range(NUM)
    ]

    async def main() -> tuple[dict[str, Sample], dict[str, Sample]]:
        async with asyncio.timeout(120), Job(specs, config) as job:
            (address,) = await job.call("rollout", "engine_address")
            assert address.values["kind"] == "sglang" and address.device == 0
            url = str(address.values["url"])
            assert str(address.values["name"]) == f"sglang@{url.removeprefix('http://')}"
            async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as reply:
                assert reply.status == 200  # where a trainer would push its weights
            job.submit("rollout", requests)
            generated = await collect(job, "rollout", NUM)
            job.submit("inference", list(generated.values()))
            return generated, await collect(job, "inference", NUM)

    generated, scored = asyncio.run(main())
    for sample_id, sample in generated.items():
        tokens = list(unpack_tokens(sample.token_ids))
        out = scored[sample_id]
        logprobs = list(unpack_floats(out.logprobs))
        assert list(unpack_tokens(out.token_ids)) == tokens
        assert out.prompt_len == sample.prompt_len == 4
        assert len(logprobs) == len(tokens) - 1
        # The response: the log-probs it was sampled with; the prompt: the model's own.
        assert logprobs[3:] == pytest.approx(list(unpack_floats(sample.logprobs)), abs=1e-6)
        assert logprobs[:3] == pytest.approx(
            [token_logprob(tokens[:i], tokens[i]) for i in range(1, 4)], abs=1e-6
        )
        assert out.metadata["device"] == 1 and sample.metadata["device"] == 0


def test_a_device_moves_between_a_rollout_and_a_scorer_sharing_its_engine(
    tmp_path: Path,
) -> None:
    """Both components attach to the same server per device; a component giving a device
    up pauses its engine (its role sleeps), so the one taking it must resume it — or what
    it sends there waits forever (found on real SGLang: the drain of the move back timed
    out, three times, and the job went into safe mode with the scorer starved)."""

    async def main() -> None:
        engines = [setup(tmp_path, f"server{d}").build(d) for d in (0, 1)]
        async with contextlib.AsyncExitStack() as stack:
            for engine in engines:
                await engine.start()
                stack.push_async_callback(engine.aclose)
            shared = EngineSetup(
                kind="sglang", urls={str(d): str(e.url) for d, e in enumerate(engines)}
            ).to_options()
            specs = [
                ComponentSpec(role=EngineRollout, devices=(0,), options=shared, max_inflight=1),
                ComponentSpec(
                    role=EngineInference, devices=(1,), options=shared, max_inflight=1,
                    min_devices=0,
                ),
            ]  # fmt: skip
            runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True))
            config = JobConfig(run_dir=str(tmp_path / "run"), runtime=runtime)
            async with asyncio.timeout(120), Job(specs, config) as job:
                assert (await job.move([1], src="inference", dst="rollout")).ok
                requests = [
                    GenerationRequest(
                        sample_id=f"s{i}", token_ids=pack_tokens([3, i, 5]), max_new_tokens=64
                    )
                    for i in range(2 * NUM)
                ]
                job.submit("rollout", requests)
                generated = await collect(job, "rollout", 2 * NUM)
                assert {s.metadata["device"] for s in generated.values()} == {0, 1}
                # Back to the scorer: the rollout's engine there is paused, the scorer's resumed.
                assert (await job.move([1], src="rollout", dst="inference")).ok
                job.submit("inference", list(generated.values()))
                scored = await collect(job, "inference", 2 * NUM)
                assert {s.metadata["device"] for s in scored.values()} == {1}

    asyncio.run(main())
