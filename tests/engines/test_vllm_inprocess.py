"""VLLMInProcessEngine: vLLM's ``AsyncLLM`` in the test process, on the tiny Llama (markers
``engines`` and ``slow``: a third engine would not fit ``make test``'s budget).

One engine for the module, started on a loop of its own that every test runs on (vLLM's
output handler is a task of the loop that first sends it a request). Its engine core and
worker are spawned child processes; pytest's entry points guard ``__main__``, which spawn
needs. Behaviour only: greedy runs repeat, a high-priority request overtakes queued ones,
aborts (one, all, by pause) hand back prefixes of the unaborted run, a kept pause resumes as
if never paused, scoring reproduces the sampled log-probs, the load shows the running batch,
weight-version labels reach later tokens, and closing leaves no process. Three more engines,
each started by its test beside the module's: one that cannot start, one abandoned at its
start-up deadline (its close waits until what it built is shut down), one whose engine core
is killed mid-request. Where a test needs the engine in a state (requests running, tokens
generated) it waits for the engine to show it; nothing asserts a duration. About two
minutes on two cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from vllm_support import MAX_NUM_SEQS, WAIT_S, greedy_request, prompt, server_config

from dynarl.backends._engine import Engine, EngineLoad, EngineOutput, ScoreRequest
from dynarl.backends.vllm import missing_vllm
from dynarl.backends.vllm._inprocess import VLLMInProcessEngine
from dynarl.errors import BackendError

pytestmark = [
    pytest.mark.engines,
    pytest.mark.slow,
    # vLLM's Triton shim reads the deprecated torch.distributed.reduce_op while importing
    # vllm.triton_utils in this process.
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

LONG = 900
"""Tokens of a request that must still run while the test acts on it."""
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Started:
    engine: VLLMInProcessEngine
    loop: asyncio.AbstractEventLoop
    children_before: frozenset[int]
    """This process's children before the engine started."""
    ticks_during_start: int
    """How often a 50 ms ticker on the loop ran while the engine started."""

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)


def children() -> set[int]:
    """This process's live children (from ``/proc``), but multiprocessing's resource tracker
    (started by the first spawn and kept on purpose)."""
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        found |= {int(pid) for pid in (task / "children").read_text().split()}
    return {pid for pid in found if not _is_helper(pid)}


def descendants(pids: set[int]) -> set[int]:
    """``pids`` and every process below them, now."""
    found = set(pids)
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                kids = {int(child) for child in (task / "children").read_text().split()}
                found |= descendants(kids)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _is_helper(pid: int) -> bool:
    """Whether ``pid`` is gone or multiprocessing's resource tracker."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return True
    return not alive(pid) or b"multiprocessing.resource_tracker" in cmdline


@pytest.fixture(scope="module")
def started(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """The module's engine (half a minute to start), closed after its last test."""
    reason = missing_vllm(sys.executable)
    if reason is not None:
        pytest.skip(f"the in-process engine needs vLLM in this interpreter: {reason}")
    config = server_config(sys.executable, tiny_model, tmp_path_factory.mktemp("logs"))
    engine = VLLMInProcessEngine(config, device=0)
    loop = asyncio.new_event_loop()
    before = frozenset(children())
    ticks = 0

    async def start() -> None:
        nonlocal ticks

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        try:
            await engine.start()
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)

    try:
        loop.run_until_complete(start())
        yield Started(engine, loop, before, ticks)
    finally:
        loop.run_until_complete(engine.aclose())
        loop.close()


async def wait_for(
    engine: VLLMInProcessEngine, ready: Callable[[EngineLoad], bool], what: str
) -> EngineLoad:
    """The first load reading for which ``ready`` holds."""
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                load = await engine.load()
                if ready(load):
                    return load
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"the engine never reached: {what}")


async def until(condition: Callable[[], bool], what: str) -> None:
    """Until ``condition()`` holds."""
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                if condition():
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"never reached: {what}")


async def running(engine: VLLMInProcessEngine) -> None:
    """Until the engine runs a request, then a little longer so that it has sampled some
    tokens (how many does not matter: the tests retry where there were none)."""
    await wait_for(engine, lambda load: load.running >= 1, "a request running")
    await asyncio.sleep(0.2)


def test_it_is_an_engine_started_off_the_loop(started: Started) -> None:
    assert isinstance(started.engine, Engine)
    assert started.engine.name == "vllm-inprocess@0"
    assert started.run(started.engine.health())
    assert started.engine.exit_cause is None
    # Construction blocks for half a minute: the loop kept running meanwhile.
    assert started.ticks_during_start >= 3
    assert len(children() - started.children_before) >= 1  # the engine core


def test_greedy_generation_repeats_alone_and_batched(started: Started) -> None:
    engine = started.engine

    async def test() -> None:
        first = await engine.generate(greedy_request("greedy-1", 16, seed=0))
        second = await engine.generate(greedy_request("greedy-2", 16, seed=0))
        batched = await asyncio.gather(
            *(engine.generate(greedy_request(f"greedy-b{i}", 16, seed=0)) for i in range(2))
        )
        assert len(first.token_ids) == 16 and first.finish == "length"
        assert first.prompt_tokens == 12
        assert all(lp <= 0 for lp in first.logprobs)
        assert first.token_versions() == (await engine.weight_version(),) * 16
        for other in (second, *batched):
            assert other.token_ids == first.token_ids
            assert other.logprobs == first.logprobs

    started.run(test())


def test_a_high_priority_request_overtakes_queued_ones(started: Started) -> None:
    engine = started.engine
    finished: list[str] = []

    def submit(
        request_id: str, num_tokens: int, seed: int, priority: int = 0
    ) -> asyncio.Task[EngineOutput]:
        task = asyncio.ensure_future(
            engine.generate(greedy_request(request_id, num_tokens, seed, priority))
        )
        task.add_done_callback(lambda _: finished.append(request_id))
        return task

    async def test() -> None:
        tasks = [submit(f"run-{i}", LONG, seed=i) for i in range(MAX_NUM_SEQS)]
        await wait_for(engine, lambda load: load.running == MAX_NUM_SEQS, "both slots busy")
        for i in range(3):
            tasks.append(submit(f"q-{i}", 24, seed=10 + i))
            await asyncio.sleep(0)  # each registered in this order
        tasks.append(submit("high", 24, seed=20, priority=10))
        load = await wait_for(engine, lambda load: load.waiting >= 1, "requests queued")
        assert load.running == MAX_NUM_SEQS, "the long runs ended before the test could queue"
        results = await asyncio.gather(*tasks)
        assert all(result.finish == "length" for result in results)

    started.run(test())
    assert set(finished[:MAX_NUM_SEQS]) == {f"run-{i}" for i in range(MAX_NUM_SEQS)}
    # First in, first out would run q-0 and q-1 before it, and q-2 beside it.
    assert finished.index("high") < min(finished.index("q-1"), finished.index("q-2")), finished


def test_an_aborted_request_returns_a_prefix_of_the_full_run(started: Started) -> None:
    engine = started.engine

    async def test() -> None:
        for attempt in range(5):
            task = asyncio.ensure_future(engine.generate(greedy_request(f"cut{attempt}", LONG, 3)))
            await running(engine)
            await engine.abort(f"cut{attempt}")
            partial = await task
            if partial.aborted and partial.token_ids:
                break
        else:
            pytest.fail("no abort ever cut a request that had sampled tokens")
        num = len(partial.token_ids)
        assert num < LONG
        assert partial.token_versions() == (await engine.weight_version(),) * num
        full = await engine.generate(greedy_request("full", num, 3))
        assert partial.token_ids == full.token_ids
        assert partial.logprobs == full.logprobs

    started.run(test())


def test_an_abort_right_after_submission_ends_the_request(started: Started) -> None:
    """In flight from the call on: an abort as soon as the request's task has run once
    (vLLM has not stepped it yet) still ends it."""
    engine = started.engine

    async def test() -> None:
        task = asyncio.ensure_future(engine.generate(greedy_request("early", LONG, 4)))
        await asyncio.sleep(0)
        await engine.abort("early")
        early = await task
        assert early.finish == "abort"
        assert len(early.token_ids) < LONG
        await engine.abort("no-such-request")  # ignored

    started.run(test())


def test_abort_all_ends_every_request_with_its_partial_output(started: Started) -> None:
    engine = started.engine

    async def test() -> None:
        tasks = [
            asyncio.ensure_future(engine.generate(greedy_request(f"all-{i}", LONG, i)))
            for i in range(3)
        ]
        await wait_for(engine, lambda load: load.running + load.waiting == 3, "all three in")
        await engine.abort_all()
        results = await asyncio.gather(*tasks)
        assert [result.finish for result in results] == ["abort"] * 3
        assert all(len(result.token_ids) < LONG for result in results)

    started.run(test())


def test_pause_keep_then_resume_equals_no_pause(started: Started) -> None:
    engine = started.engine

    async def test() -> None:
        for attempt in range(5):
            task = asyncio.ensure_future(engine.generate(greedy_request(f"kept{attempt}", LONG, 5)))
            await running(engine)
            await engine.pause("keep")
            try:
                assert await engine.is_paused()
                frozen = not task.done()
                await asyncio.sleep(0.2)
                assert frozen == (not task.done())  # nothing runs while paused
            finally:
                await engine.resume()
            kept = await task
            if frozen:
                break
        else:
            pytest.fail("every request finished before the pause reached the engine")
        assert not await engine.is_paused()
        plain = await engine.generate(greedy_request("plain", LONG, 5))
        assert kept.finish == plain.finish == "length"
        assert kept.token_ids == plain.token_ids
        assert kept.logprobs == plain.logprobs

    started.run(test())


def test_pause_abort_returns_partial_outputs_and_later_requests_wait(started: Started) -> None:
    engine = started.engine

    async def test() -> None:
        task = asyncio.ensure_future(engine.generate(greedy_request("paused", LONG, 6)))
        await running(engine)
        await engine.pause("abort")
        try:
            cut = await task
            later = asyncio.ensure_future(engine.generate(greedy_request("later", 8, 6)))
            await asyncio.sleep(0.3)
            assert not later.done()  # queued until resume
        finally:
            await engine.resume()
        assert cut.finish == "abort" and len(cut.token_ids) < LONG
        after = await later
        assert after.finish == "length"
        shared = min(len(cut.token_ids), len(after.token_ids))
        assert cut.token_ids[:shared] == after.token_ids[:shared]

    started.run(test())


def test_pause_wait_returns_once_running_requests_finish(started: Started) -> None:
    engine = started.engine

    async def test() -> None:
        task = asyncio.ensure_future(engine.generate(greedy_request("drained", 200, 7)))
        await wait_for(engine, lambda load: load.running >= 1, "a request running")
        await engine.pause("wait")
        try:
            assert task.done()
        finally:
            await engine.resume()
        assert (await task).finish == "length"
        with pytest.raises(ValueError, match=r"vllm-inprocess@0.*retract"):
            await engine.pause("retract")

    started.run(test())


def test_scoring_reproduces_the_sampled_log_probs(started: Started) -> None:
    engine = started.engine

    async def test() -> None:
        output = await engine.generate(greedy_request("to-score", 24, 8))
        sequence = tuple(prompt(12, 8)) + output.token_ids
        scores = await engine.score(ScoreRequest(request_id="score", token_ids=sequence))
        assert len(scores) == len(sequence) - 1
        assert scores[-24:] == pytest.approx(output.logprobs, abs=1e-4)

    started.run(test())


def test_load_shows_the_running_batch_up_to_its_limit(started: Started) -> None:
    engine = started.engine
    readings: list[EngineLoad] = []

    async def test() -> None:
        idle = await engine.load()
        assert idle.max_running == MAX_NUM_SEQS
        tasks = [
            asyncio.ensure_future(engine.generate(greedy_request(f"load-{i}", LONG, i)))
            for i in range(MAX_NUM_SEQS + 2)
        ]
        readings.append(
            await wait_for(
                engine,
                lambda load: load.running == MAX_NUM_SEQS and load.waiting >= 1,
                "a full batch and a queue",
            )
        )
        await engine.abort_all()
        await asyncio.gather(*tasks)
        readings.append(await engine.load())

    started.run(test())
    full, after = readings
    assert full.utilization == 1.0
    assert after.prefix_query_tokens >= full.prefix_query_tokens > 0
    assert all(0.0 <= r.kv_usage <= 1.0 and r.running <= MAX_NUM_SEQS for r in readings)


def test_set_weight_version_labels_later_tokens(started: Started) -> None:
    engine = started.engine

    async def test() -> None:
        await engine.set_weight_version("step-1")
        assert await engine.weight_version() == "step-1"
        short = await engine.generate(greedy_request("labelled", 4, 0))
        assert short.token_versions() == ("step-1",) * 4
        for attempt in range(5):
            before, after = f"step-{attempt}.a", f"step-{attempt}.b"
            await engine.set_weight_version(before)
            task = asyncio.ensure_future(
                engine.generate(greedy_request(f"relabel{attempt}", LONG, 2))
            )
            await running(engine)
            await engine.set_weight_version(after)
            output = await task
            if len(output.versions) == 2:
                break
        else:
            pytest.fail("every request finished before the new label reached the engine")
        first, second = output.versions
        assert (first.version, first.start) == (before, 0)
        assert (second.version, second.end) == (after, LONG)
        assert first.end == second.start > 0

    started.run(test())


def test_bad_requests_raise_value_error_naming_the_engine(started: Started) -> None:
    engine = started.engine

    async def test() -> None:
        out_of_vocabulary = dataclasses.replace(greedy_request("oov", 4, 0), token_ids=(10**6,))
        with pytest.raises(ValueError, match=r"vllm-inprocess@0.*'oov'.*vocabulary"):
            await engine.generate(out_of_vocabulary)
        task = asyncio.ensure_future(engine.generate(greedy_request("twice", LONG, 1)))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match=r"vllm-inprocess@0.*'twice' is already in flight"):
            await engine.generate(greedy_request("twice", 4, 1))
        await engine.abort("twice")
        assert (await task).finish == "abort"

    started.run(test())


def test_collective_rpc_reaches_the_worker_extension(started: Started) -> None:
    assert started.run(started.engine.collective_rpc("dynarl_leave_weight_group")) == [None]


def test_an_engine_that_cannot_start_names_itself(tmp_path: Path, tiny_model: Path) -> None:
    config = dataclasses.replace(
        server_config(sys.executable, tmp_path / "no-such-model", tmp_path), startup_timeout_s=120
    )
    missing = VLLMInProcessEngine(config, device="broken")
    server_flags = VLLMInProcessEngine(
        dataclasses.replace(
            server_config(sys.executable, tiny_model, tmp_path),
            extra_args=("--uvicorn-log-level", "info"),
        ),
        device="flags",
    )

    async def test() -> None:
        with pytest.raises(BackendError, match=r"vllm-inprocess@broken.*failed to start"):
            await missing.start()
        assert not await missing.health()
        await missing.aclose()
        with pytest.raises(ValueError, match=r"vllm-inprocess@flags.*--uvicorn-log-level"):
            await server_flags.start()

    asyncio.run(test())


def test_a_start_past_its_deadline_fails_and_aclose_waits_out_the_abandoned_engine(
    started: Started, tmp_path: Path, tiny_model: Path
) -> None:
    """The module's engine stays up meanwhile: a second one, abandoned at its deadline,
    builds in the background and shuts down what it built; aclose waits for that."""
    config = dataclasses.replace(
        server_config(sys.executable, tiny_model, tmp_path), startup_timeout_s=1.0
    )
    late = VLLMInProcessEngine(config, device="late")
    before = children()

    async def test() -> None:
        with pytest.raises(
            BackendError, match=r"vllm-inprocess@late: vLLM did not start within 1.0 s"
        ):
            await late.start()
        assert not await late.health()
        await late.aclose()

    asyncio.run(test())
    assert children() <= before
    assert started.run(started.engine.health())


def test_an_engine_whose_core_is_killed_reports_it_and_leaves_nothing(
    started: Started, tmp_path: Path, tiny_model: Path
) -> None:
    """A second engine (the module's stays up): its engine core killed mid-request."""
    doomed = VLLMInProcessEngine(
        server_config(sys.executable, tiny_model, tmp_path), device="doomed"
    )
    before = children()

    async def test() -> None:
        await doomed.start()
        tree = descendants(children() - before)
        task = asyncio.ensure_future(doomed.generate(greedy_request("cut-off", LONG, 1)))
        await wait_for(doomed, lambda load: load.running >= 1, "a request running")
        for pid in children() - before:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(BackendError, match=r"vllm-inprocess@doomed: request 'cut-off'"):
            await task
        await until(lambda: doomed.exit_cause is not None, "the death noticed")
        assert doomed.exit_cause == "engine core died: killed by SIGKILL"
        assert not await doomed.health()
        with pytest.raises(BackendError, match=r"vllm-inprocess@doomed"):
            await doomed.generate(greedy_request("too-late", 4, 1))
        await doomed.aclose()
        # The worker, orphaned, notices its engine core is gone and exits (seconds).
        await until(lambda: not any(alive(pid) for pid in tree), "every process gone")

    asyncio.run(test())
    assert children() <= before
    assert started.run(started.engine.health())


def test_aclose_leaves_no_process_and_is_idempotent(started: Started) -> None:
    """Last: it closes the module's engine."""
    engine = started.engine

    async def test() -> None:
        running_task = asyncio.ensure_future(engine.generate(greedy_request("at-close", LONG, 9)))
        await wait_for(engine, lambda load: load.running >= 1, "a request running")
        await engine.aclose()
        assert (await running_task).finish == "abort"  # handed back, not left hanging
        await engine.aclose()
        assert not await engine.health()
        assert engine.exit_cause is None
        with pytest.raises(RuntimeError, match="not started"):
            await engine.load()

    started.run(test())
    assert children() <= started.children_before
