"""The serving role on real vLLM engines: the adapter behind it, then a ``dynarl.Job``.

The adapter (``VLLMEngine``) reports utilization that follows the number of running
requests up to ``max_num_seqs``, and labels tokens with the weight version it was told.
The job hosts :class:`EngineRollout` on two devices attached to the session's two
servers, and a trainer on a third; moving a rollout device to the trainer mid-generation
drains its engine (abort, partial token ids back, continuation on the other engine):
every request comes back once, and each resumed one carries the tokens and log-probs an
uninterrupted greedy run gives, within an fp32 bound.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from vllm_support import MAX_NUM_SEQS, WAIT_S, greedy_request, prompt

from dynarl.backends.serving import CACHED_TOKENS, EngineRequest, EngineRollout, EngineSetup
from dynarl.backends.vllm import VLLMClient, VLLMEngine, VLLMServer
from dynarl.bus import GenerationRequest, Sample, pack_tokens, unpack_floats, unpack_tokens
from dynarl.runtime import VERSIONS, ComponentSpec, Job, JobConfig, RuntimeConfig, decode_versions
from dynarl.runtime._worker_protocol import RESUMED
from dynarl.sched import SchedulerConfig
from dynarl.testing import TinyTrainer

pytestmark = pytest.mark.engines

LOGPROB_TOL = 1e-3
"""fp32: the same tokens scored in one prefill or decoded one by one differ by rounding."""


def attach(server: VLLMServer) -> VLLMEngine:
    return VLLMEngine(url=server.url, max_num_seqs=MAX_NUM_SEQS)


def attached_job(
    a: VLLMServer, b: VLLMServer, run_dir: Path, *, max_inflight: int = 8
) -> tuple[list[ComponentSpec], JobConfig]:
    """A job whose rollout is the role attached to servers ``a`` (device 0) and ``b``
    (device 1), a trainer on device 2, the scheduler observing only."""
    setup = EngineSetup(
        urls={"0": a.url, "1": b.url}, max_num_seqs=MAX_NUM_SEQS, metrics_interval_s=0.2
    )
    rollout = ComponentSpec(
        role=EngineRollout, devices=(0, 1), options=setup.to_options(), max_inflight=max_inflight
    )
    config = JobConfig(
        run_dir=str(run_dir), runtime=RuntimeConfig(scheduler=SchedulerConfig(observe_only=True))
    )
    return [rollout, ComponentSpec(role=TinyTrainer, devices=(2,))], config


def test_utilization_follows_running_requests_up_to_the_limit(vllm_server: VLLMServer) -> None:
    async def main() -> list[float]:
        engine = attach(vllm_server)
        await engine.start()
        seen = [(await engine.load()).utilization]
        tasks = []
        try:
            for n in range(1, MAX_NUM_SEQS + 2):
                tasks.append(asyncio.create_task(engine.generate(greedy_request(f"u{n}", 900, n))))
                want = min(n, MAX_NUM_SEQS)
                async with asyncio.timeout(WAIT_S):
                    while True:
                        load = await engine.load()
                        if load.running >= want:
                            break
                        await asyncio.sleep(0.02)
                seen.append(load.utilization)
        finally:
            await engine.abort_all()
            await asyncio.gather(*tasks, return_exceptions=True)
            await engine.aclose()
        return seen

    seen = asyncio.run(main())
    # Idle, one of two slots, both, both with one more queued (KV use stays tiny).
    assert seen == pytest.approx([0.0, 0.5, 1.0, 1.0], abs=0.02)


def test_tokens_report_the_weight_version_set(vllm_server: VLLMServer) -> None:
    async def main() -> tuple[tuple[str, ...], tuple[str, ...]]:
        engine = attach(vllm_server)
        await engine.start()
        try:
            await engine.set_weight_version("7")
            first = await engine.generate(greedy_request("v7", 8, 1))
            await engine.set_weight_version("8")
            second = await engine.generate(greedy_request("v8", 8, 1))
        finally:
            await engine.set_weight_version("0")
            await engine.aclose()
        assert first.token_ids == second.token_ids  # a label, not new weights
        return first.token_versions(), second.token_versions()

    assert asyncio.run(main()) == (("7",) * 8, ("8",) * 8)


def test_a_rollout_device_moved_mid_generation_loses_nothing(
    vllm_server: VLLMServer, vllm_server_b: VLLMServer, tmp_path: Path
) -> None:
    # As many in flight per worker as its engine runs: the rest wait in the dispatcher, so
    # both engines get work.
    specs, config = attached_job(vllm_server, vllm_server_b, tmp_path, max_inflight=MAX_NUM_SEQS)
    lengths = [900, 900, 900, 900, 300, 300]
    requests = [
        GenerationRequest(
            sample_id=f"s{i}",
            token_ids=pack_tokens(prompt(12, 100 + i)),
            max_new_tokens=length,
            temperature=0.0,
        )
        for i, length in enumerate(lengths)
    ]

    async def main() -> list[Sample]:
        async with asyncio.timeout(WAIT_S), Job(specs, config) as job:
            job.submit("rollout", requests)
            await freeze_mid_generation(vllm_server_b)
            outcome = await job.move([1], src="rollout", dst="trainer")
            assert outcome.ok, outcome.reason
            out = job.output("rollout")
            return [await out.get(timeout=WAIT_S) for _ in requests]

    samples = asyncio.run(main())
    assert Counter(s.sample_id for s in samples) == Counter(r.sample_id for r in requests)
    resumed = [s for s in samples if s.metadata[RESUMED]]
    assert resumed, "the move aborted nothing: no request was running on device 1"
    assert all(s.metadata["device"] == 0 for s in resumed)
    by_id = {r.sample_id: r for r in requests}
    # The job paused the engines it put to sleep and resumed them when it ended.
    assert not asyncio.run(paused(vllm_server)) and not asyncio.run(paused(vllm_server_b))
    reference = asyncio.run(uninterrupted(vllm_server, [by_id[s.sample_id] for s in resumed]))
    for sample in resumed:
        request = by_id[sample.sample_id]
        tokens, logprobs = reference[sample.sample_id]
        new = unpack_tokens(sample.token_ids)[sample.prompt_len :].tolist()
        assert sample.prompt_len == len(unpack_tokens(request.token_ids))
        assert new == tokens, sample.sample_id
        assert unpack_floats(sample.logprobs) == pytest.approx(logprobs, abs=LOGPROB_TOL)
        assert decode_versions(str(sample.metadata[VERSIONS])) == [0] * len(new)


async def freeze_mid_generation(server: VLLMServer) -> None:
    """Once ``server`` is generating, pause it in place (a warm engine finishes a request in
    a second or two: frozen, its requests are surely mid-generation when the move comes)."""
    async with VLLMClient(server.client_config()) as client:
        before = (await client.load()).generation_tokens
        try:
            async with asyncio.timeout(WAIT_S):
                while True:
                    load = await client.load()
                    if load.num_running and load.generation_tokens > before + 16:
                        await client.pause("keep")
                        return
                    await asyncio.sleep(0.01)
        except TimeoutError:
            pytest.fail("the job never had device 1's engine generating")


async def paused(server: VLLMServer) -> bool:
    """Whether ``server`` is paused."""
    async with VLLMClient(server.client_config()) as client:
        return await client.is_paused()


async def uninterrupted(
    server: VLLMServer, requests: list[GenerationRequest]
) -> dict[str, tuple[list[int], list[float]]]:
    """Each request run to its end without a move, greedy."""
    engine = VLLMEngine(url=server.url, max_num_seqs=MAX_NUM_SEQS)
    await engine.start()
    try:
        outputs = await asyncio.gather(
            *(
                engine.generate(
                    EngineRequest(
                        request_id=f"ref-{r.sample_id}",
                        token_ids=tuple(unpack_tokens(r.token_ids).tolist()),
                        max_new_tokens=r.max_new_tokens,
                        temperature=0.0,
                    )
                )
                for r in requests
            )
        )
    finally:
        await engine.aclose()
    return {
        r.sample_id: (list(o.token_ids), list(o.logprobs))
        for r, o in zip(requests, outputs, strict=True)
    }


def test_a_shared_prefix_of_two_blocks_is_served_from_the_cache(vllm_server: VLLMServer) -> None:
    shared = tuple(prompt(300, seed=42))  # CPU blocks are 128 tokens: two whole blocks

    async def main() -> tuple[int, int, float]:
        engine = attach(vllm_server)
        await engine.start()
        try:
            before = await engine.load()
            first = await engine.generate(
                EngineRequest(request_id="pre-1", token_ids=shared, max_new_tokens=4)
            )
            second = await engine.generate(
                EngineRequest(request_id="pre-2", token_ids=(*shared, 1, 2, 3), max_new_tokens=4)
            )
            after = await engine.load()
        finally:
            await engine.aclose()
        hits = after.prefix_hit_tokens - before.prefix_hit_tokens
        return first.cached_tokens, second.cached_tokens, hits

    first, second, hits = asyncio.run(main())
    assert (first, second) == (0, 256)
    assert hits == 256  # the engine's own counter agrees with the per-request figure


def test_an_episodes_turns_go_back_to_the_engine_that_holds_its_prefix(
    vllm_server: VLLMServer, vllm_server_b: VLLMServer, tmp_path: Path
) -> None:
    """A multi-turn loop (generate, a tool answers, generate again on the whole episode):
    each turn goes back to the engine that served the episode, whose prefix cache holds it;
    once that device leaves the rollout, the episode goes on on the other engine."""
    specs, config = attached_job(vllm_server, vllm_server_b, tmp_path)
    tool_answer = tuple(prompt(40, 999))
    # 300 prompt tokens: two whole 128-token blocks to find in the cache on the next turn.
    contexts = {f"e{i}": tuple(prompt(300, 300 + i)) for i in range(2)}
    served: dict[str, list[tuple[int, int]]] = {episode: [] for episode in contexts}
    moved: list[int] = []

    async def main() -> None:
        async with asyncio.timeout(WAIT_S), Job(specs, config) as job:
            out = job.output("rollout")
            for turn in range(3):
                if turn == 2:  # the device that served e0 leaves the rollout
                    device = served["e0"][-1][0]
                    outcome = await job.move([device], src="rollout", dst="trainer")
                    assert outcome.ok, outcome.reason
                    moved.append(device)
                job.submit(
                    "rollout",
                    [
                        GenerationRequest(
                            sample_id=f"{episode}-turn{turn}",
                            token_ids=pack_tokens(context),
                            max_new_tokens=8,
                            temperature=0.0,
                            metadata={"episode": episode, "affinity": "prefer", "tool_calls": turn},
                        )
                        for episode, context in contexts.items()
                    ],
                )
                for _ in contexts:
                    sample = await out.get(timeout=WAIT_S)
                    episode = str(sample.metadata["episode"])
                    device, cached = sample.metadata["device"], sample.metadata[CACHED_TOKENS]
                    assert isinstance(device, int) and isinstance(cached, int)
                    served[episode].append((device, cached))
                    contexts[episode] = (*unpack_tokens(sample.token_ids).tolist(), *tool_answer)

    asyncio.run(main())
    (gone,) = moved
    for episode, turns in served.items():
        (first, _), (second, cached) = turns[0], turns[1]
        assert second == first and cached >= 256, (episode, turns)  # back to its prefix
        assert turns[2][0] != gone, (episode, turns)
    assert {turns[0][0] for turns in served.values()} == {0, 1}  # one episode per engine
    stayed = next(e for e, turns in served.items() if turns[0][0] != gone)
    assert served[stayed][2][0] == served[stayed][0][0] and served[stayed][2][1] >= 256
