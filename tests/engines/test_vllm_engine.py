"""VLLMClient against a real vLLM server (one for the session; see ``conftest.py``).

Behaviour only: greedy runs repeat, a high-priority request overtakes queued ones, an
aborted request hands back a prefix of the unaborted run, a paused request resumes as if
never paused. Where a test needs the server in a given state (requests queued, tokens
generated) it waits for ``/metrics`` to show it; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from vllm_support import MAX_NUM_SEQS, WAIT_S, prompt, server_config

from dynarl.backends.vllm import (
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    VLLMClient,
    VLLMLoad,
    VLLMServer,
)
from dynarl.errors import BackendError

pytestmark = pytest.mark.engines

LONG = 900
"""Tokens of a request that must still run while the test acts on it (a ``/metrics`` scrape
can take a second on a loaded machine; 900 tokens take several)."""


def greedy(
    request_id: str, num_tokens: int, *, seed: int = 0, priority: int = 0
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        token_ids=prompt(12, seed),
        sampling_params=SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True),
        priority=priority,
    )


async def wait_for(client: VLLMClient, ready: Callable[[VLLMLoad], bool], what: str) -> VLLMLoad:
    """The first ``/metrics`` reading for which ``ready`` holds."""
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                load = await client.load()
                if ready(load):
                    return load
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail(f"the server never reached: {what}")


async def generated_tokens(client: VLLMClient) -> int:
    return (await client.load()).generation_tokens


def run(server: VLLMServer, test: Callable[[VLLMClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with VLLMClient(server.client_config()) as client:
            await test(client)

    asyncio.run(main())


def test_greedy_generation_repeats_alone_and_batched(vllm_server: VLLMServer) -> None:
    async def test(client: VLLMClient) -> None:
        assert await client.health()
        first = await client.generate(greedy("greedy-1", 16))
        second = await client.generate(greedy("greedy-2", 16))
        batched = await asyncio.gather(
            *(client.generate(greedy(f"greedy-b{i}", 16)) for i in range(2))
        )
        assert len(first.token_ids) == 16 and first.finish_reason == "length"
        assert first.prompt_tokens == 12
        assert all(lp <= 0 for lp in first.logprobs)
        # The label the server has now (other tests of the session set theirs).
        assert first.token_versions() == (await client.weight_version(),) * 16
        for other in (second, *batched):
            assert other.token_ids == first.token_ids
            assert other.logprobs == first.logprobs

    run(vllm_server, test)


def test_a_high_priority_request_overtakes_queued_ones(vllm_server: VLLMServer) -> None:
    finished: list[str] = []

    async def submit(client: VLLMClient, request: GenerateRequest) -> asyncio.Task[GenerateResult]:
        task = asyncio.ensure_future(client.generate(request))
        task.add_done_callback(lambda _: finished.append(request.request_id))
        return task

    async def test(client: VLLMClient) -> None:
        tasks = [
            await submit(client, greedy(f"run-{i}", LONG, seed=i)) for i in range(MAX_NUM_SEQS)
        ]
        await wait_for(client, lambda load: load.num_running == MAX_NUM_SEQS, "both slots busy")
        # Queued behind the long runs, the high-priority one sent last. No scrape between
        # the sends: a warm server finishes a long run in a second or two, and a /metrics
        # scrape on a loaded machine can take one.
        for i in range(3):
            tasks.append(await submit(client, greedy(f"q-{i}", 24, seed=10 + i)))
            await asyncio.sleep(0.02)  # sent in this order
        tasks.append(await submit(client, greedy("high", 24, seed=20, priority=10)))
        load = await wait_for(client, lambda load: load.num_waiting >= 1, "requests queued")
        assert load.num_running == MAX_NUM_SEQS, "the long runs ended before the test could queue"
        results = await asyncio.gather(*tasks)
        assert all(result.finish_reason == "length" for result in results)

    run(vllm_server, test)
    assert set(finished[:MAX_NUM_SEQS]) == {f"run-{i}" for i in range(MAX_NUM_SEQS)}
    # First in, first out would run q-0 and q-1 before it, and q-2 beside it.
    assert finished.index("high") < min(finished.index("q-1"), finished.index("q-2")), finished


def test_an_aborted_request_returns_a_prefix_of_the_full_run(vllm_server: VLLMServer) -> None:
    async def test(client: VLLMClient) -> None:
        # A warm server may finish the request between the reading and the abort: then
        # nothing was cut, and the next attempt tries again (a bounded number of times).
        for attempt in range(5):
            start = await generated_tokens(client)
            task = asyncio.ensure_future(client.generate(greedy(f"cut{attempt}", LONG, seed=3)))
            await wait_for(client, lambda load, s=start: load.generation_tokens >= s + 8, "tokens")
            await client.abort(f"cut{attempt}")
            partial = await task
            if partial.aborted:
                break
        else:
            pytest.fail("every request finished before the abort reached the engine")
        num = len(partial.token_ids)
        assert num > 0
        assert partial.token_versions() == (await client.weight_version(),) * num
        full = await client.generate(greedy("full", num, seed=3))
        assert partial.token_ids == full.token_ids
        assert partial.logprobs == full.logprobs

    run(vllm_server, test)


def test_abort_all_ends_every_request_with_its_partial_output(vllm_server: VLLMServer) -> None:
    async def test(client: VLLMClient) -> None:
        # One reading, then abort: a warm server finishes a long run in a second or two.
        # Where one ended first anyway, the next attempt tries again (bounded).
        for attempt in range(5):
            tasks = [
                asyncio.ensure_future(client.generate(greedy(f"all{attempt}-{i}", LONG, seed=i)))
                for i in range(3)
            ]
            await wait_for(client, lambda load: load.num_running + load.num_waiting == 3, "all")
            aborted = await client.abort_all()
            results = await asyncio.gather(*tasks)
            if aborted == 3:
                break
        else:
            pytest.fail("a request always finished before the abort reached the engine")
        assert [result.finish_reason for result in results] == ["abort"] * 3
        assert all(len(result.token_ids) < LONG for result in results)

    run(vllm_server, test)


def test_pause_keep_then_resume_equals_no_pause(vllm_server: VLLMServer) -> None:
    async def test(client: VLLMClient) -> None:
        # A warm server may finish the request between the reading and the pause: then
        # nothing was kept, and the next attempt tries again (a bounded number of times).
        for attempt in range(5):
            start = await generated_tokens(client)
            task = asyncio.ensure_future(client.generate(greedy(f"kept{attempt}", LONG, seed=5)))
            await wait_for(client, lambda load, s=start: load.generation_tokens >= s + 8, "tokens")
            await client.pause("keep")
            try:
                assert await client.is_paused()
                frozen = not task.done()
            finally:
                await client.resume()
            kept = await task
            if frozen:
                break
        else:
            pytest.fail("every request finished before the pause reached the engine")
        assert not await client.is_paused()
        plain = await client.generate(greedy("plain", LONG, seed=5))
        assert kept.finish_reason == plain.finish_reason == "length"
        assert kept.token_ids == plain.token_ids
        assert kept.logprobs == plain.logprobs

    run(vllm_server, test)


@pytest.mark.slow
def test_a_server_that_cannot_start_names_vllm_and_shows_its_log(
    engine_python: str, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-model"
    server = VLLMServer(server_config(engine_python, missing, tmp_path / "logs"))

    async def main() -> None:
        with pytest.raises(BackendError, match=r"(?s)vLLM server exited with \d+.*no-such-model"):
            await server.start()

    asyncio.run(main())
    assert server.pid is None
    assert list((tmp_path / "logs").glob("vllm-*.log"))
