"""The serving path: routing, partial outputs, re-dispatch, parking — with in-process workers."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest

from dynarl.bus import GenerationRequest, Sample, pack_tokens, unpack_tokens
from dynarl.errors import PeerLostError
from dynarl.runtime._worker_protocol import FINISH, PROMPT_LEN, RESUMED, AbortInflight, Done
from dynarl.runtime.controller._dispatch import Dispatcher
from dynarl.runtime.controller._progress import Progress
from dynarl.runtime.durable._manifest import Manifest
from dynarl.testing import scripted_token

PROMPT = [7, 8, 9]


class Workers:
    """In-process stand-ins for serving workers: scripted tokens, one per tick."""

    def __init__(self, *, lost: Sequence[int] = ()) -> None:
        self.aborts: dict[int, asyncio.Event] = {}
        self.served: Counter[int] = Counter()
        self.lost = set(lost)
        self.running: Counter[int] = Counter()
        self.peak: Counter[int] = Counter()

    async def serve(self, device: int, item: Any, *, deadline_s: float) -> Sample:
        assert isinstance(item, GenerationRequest)
        if device in self.lost:
            raise PeerLostError(f"worker/{device}")
        self.served[device] += 1
        self.running[device] += 1
        self.peak[device] = max(self.peak[device], self.running[device])
        abort = self.aborts.setdefault(device, asyncio.Event())
        tokens = [int(t) for t in unpack_tokens(item.token_ids)]
        new: list[int] = []
        try:
            while len(new) < item.max_new_tokens and not abort.is_set():
                await asyncio.sleep(0.002)
                new.append(scripted_token(0, item.sample_id, len(tokens) + len(new), 1000))
        finally:
            self.running[device] -= 1
        finish = "length" if len(new) == item.max_new_tokens else "abort"
        return Sample(
            sample_id=item.sample_id,
            token_ids=pack_tokens(tokens + new),
            prompt_len=len(tokens),
            metadata={**item.metadata, FINISH: finish, "device": device},
        )

    async def ask_all(
        self, devices: Sequence[int], message: Any, reply: type, *, deadline_s: float | None = None
    ) -> list[Done]:
        assert isinstance(message, AbortInflight)
        for device in devices:
            self.aborts.setdefault(device, asyncio.Event()).set()
            self.aborts[device] = asyncio.Event()
        return [Done() for _ in devices]


class Roles:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    async def activate(self, devices: Sequence[int]) -> None:
        self.calls.append(("activate", tuple(devices)))

    async def release(self, devices: Sequence[int]) -> None:
        self.calls.append(("release", tuple(devices)))


def requests(count: int, length: int = 40) -> list[GenerationRequest]:
    return [
        GenerationRequest(sample_id=f"r{i}", token_ids=pack_tokens(PROMPT), max_new_tokens=length)
        for i in range(count)
    ]


def expected(sample_id: str, length: int) -> list[int]:
    positions = range(len(PROMPT), len(PROMPT) + length)
    return PROMPT + [scripted_token(0, sample_id, p, 1000) for p in positions]


def run(
    scenario: Callable[[Dispatcher, Workers, Roles, list[Sample]], Awaitable[None]],
    workers: Workers | None = None,
) -> list[Sample]:
    async def main() -> list[Sample]:
        fake, roles, out = workers or Workers(), Roles(), []

        async def sink(sample: Sample) -> None:
            out.append(sample)

        dispatcher = Dispatcher(
            "rollout",
            link=fake,  # type: ignore[arg-type]
            roles=roles,
            output=sink,
            max_inflight=2,
            item_timeout_s=30.0,
            drain_timeout_s=5.0,
        )
        stop = asyncio.Event()
        async with asyncio.timeout(30), asyncio.TaskGroup() as group:
            group.create_task(dispatcher.run(stop))
            await asyncio.sleep(0)
            await scenario(dispatcher, fake, roles, out)
            stop.set()
        return out

    return asyncio.run(main())


async def delivered(out: list[Sample], count: int) -> None:
    for _ in range(4000):
        if len(out) >= count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{len(out)} of {count} items delivered")


def test_every_item_is_served_once_within_the_inflight_bound() -> None:
    workers = Workers()

    async def scenario(d: Dispatcher, w: Workers, roles: Roles, out: list[Sample]) -> None:
        d.add_worker(0)
        d.add_worker(1)
        d.submit(requests(9, length=5))
        with pytest.raises(ValueError, match="already submitted"):
            d.submit(requests(1))
        await delivered(out, 9)

    out = run(scenario, workers)
    assert sorted(s.sample_id for s in out) == sorted(f"r{i}" for i in range(9))
    assert all(list(unpack_tokens(s.token_ids)) == expected(s.sample_id, 5) for s in out)
    assert max(workers.peak.values()) <= 2 and set(workers.served) == {0, 1}


def test_a_drained_worker_hands_its_partials_to_the_others_with_no_loss() -> None:
    async def scenario(d: Dispatcher, w: Workers, roles: Roles, out: list[Sample]) -> None:
        d.add_worker(0)
        d.add_worker(1)
        d.submit(requests(6, length=60))
        await asyncio.sleep(0.03)
        await d.stop_routing([1])
        partials = await d.abort_inflight([1])
        assert partials and all(0 < len(p.generated) < 60 for p in partials)
        assert all(p.prompt == tuple(PROMPT) and p.affinity_worker == 1 for p in partials)
        await d.redispatch(partials, [0])
        await d.release([1])
        assert roles.calls == [("release", (1,))]
        await delivered(out, 6)

    out = run(scenario)
    assert Counter(s.sample_id for s in out) == Counter(f"r{i}" for i in range(6))
    assert all(list(unpack_tokens(s.token_ids)) == expected(s.sample_id, 60) for s in out)
    assert all(s.prompt_len == len(PROMPT) for s in out)
    assert any(s.metadata[RESUMED] for s in out) and {s.metadata["device"] for s in out} == {0}


def test_a_partial_that_already_reached_its_length_is_returned_once() -> None:
    class Finished(Workers):
        async def serve(self, device: int, item: Any, *, deadline_s: float) -> Sample:
            sample = await super().serve(device, item, deadline_s=deadline_s)
            # Aborted exactly as the last token came out: the engine says "abort".
            return Sample(
                sample_id=sample.sample_id,
                token_ids=sample.token_ids,
                prompt_len=sample.prompt_len,
                metadata={**sample.metadata, FINISH: "abort"},
            )

    workers = Finished()

    async def scenario(d: Dispatcher, w: Workers, roles: Roles, out: list[Sample]) -> None:
        d.add_worker(0)
        d.submit(requests(2, length=4))
        await delivered(out, 2)
        await asyncio.sleep(0.05)

    out = run(scenario, workers)
    assert sorted(s.sample_id for s in out) == ["r0", "r1"]
    assert all(s.metadata[FINISH] == "length" for s in out)
    assert workers.served[0] == 2


def test_items_wait_without_workers_and_survive_a_lost_one() -> None:
    workers = Workers(lost=[1])

    async def scenario(d: Dispatcher, w: Workers, roles: Roles, out: list[Sample]) -> None:
        d.submit(requests(4, length=3))
        await asyncio.sleep(0.02)
        assert d.queue_depth == 4 and d.remaining == 4 and not out
        d.add_worker(1)
        d.add_worker(0)
        await delivered(out, 4)
        assert d.workers == (0,) and d.remaining == 0

    out = run(scenario, workers)
    assert Counter(s.sample_id for s in out) == Counter(f"r{i}" for i in range(4))
    assert all(list(unpack_tokens(s.token_ids)) == expected(s.sample_id, 3) for s in out)


def test_a_continuation_keeps_positions_budget_and_log_probabilities() -> None:
    request = GenerationRequest(
        sample_id="x",
        token_ids=pack_tokens(PROMPT),
        max_new_tokens=5,
        priority=3,
        seed=11,
        metadata={"tool_calls": 2, "affinity": "must", "episode": "e"},
    )
    progress = Progress(original=request)
    assert progress.next_request() is request
    assert (progress.routed.status, progress.routed.episode) == (2, "e")

    def result(tokens: list[int], new: list[int], finish: str) -> Sample:
        return Sample(
            sample_id="x",
            token_ids=pack_tokens(tokens + new),
            prompt_len=len(tokens),
            logprobs=np.full(len(new), -0.5, dtype="<f4").tobytes(),
            metadata={FINISH: finish},
        )

    assert progress.absorb(result(PROMPT, [1, 2], "abort")) is None
    progress.continue_elsewhere()
    assert progress.routed.affinity == "prefer" and progress.routed.attained_service == 2
    again = progress.next_request()
    assert isinstance(again, GenerationRequest)
    assert list(unpack_tokens(again.token_ids)) == [*PROMPT, 1, 2]
    assert (again.max_new_tokens, again.seed, again.priority) == (3, 11, 3)
    assert again.metadata[PROMPT_LEN] == 3 and again.metadata[RESUMED] == 1
    final = progress.absorb(result([*PROMPT, 1, 2], [3, 4, 5], "length"))
    assert final is not None and list(unpack_tokens(final.token_ids)) == [*PROMPT, 1, 2, 3, 4, 5]
    assert final.prompt_len == 3 and len(final.logprobs) == 5 * 4
    assert PROMPT_LEN not in final.metadata and final.metadata[RESUMED] == 1
    partial = Progress(original=request).partial(worker=4)
    assert (
        partial.prompt == tuple(PROMPT)
        and partial.affinity == "must"
        and partial.affinity_worker == 4
    )


def accounted(
    scenario: Callable[[Dispatcher, Workers, Roles, list[Sample]], Awaitable[None]],
    workers: Workers,
    ids: Sequence[str],
    max_tokens: int,
) -> tuple[list[Sample], Manifest]:
    """Run ``scenario`` with a manifest attached; the samples are then scored and trained."""
    manifest = Manifest()
    for sample_id in ids:
        manifest.issue(sample_id, 0, max_tokens=max_tokens)

    async def with_manifest(d: Dispatcher, w: Workers, roles: Roles, out: list[Sample]) -> None:
        d.accounting = manifest
        await scenario(d, w, roles, out)

    out = run(with_manifest, workers)
    for sample in out:
        manifest.scored(sample.sample_id)
    manifest.trained(0, [s.sample_id for s in out])
    manifest.close_step(0)
    return out, manifest


def test_the_manifest_accounts_aborted_and_redispatched_generations_once() -> None:
    async def scenario(d: Dispatcher, w: Workers, roles: Roles, out: list[Sample]) -> None:
        d.add_worker(0)
        d.add_worker(1)
        d.submit(requests(6, length=60))
        await asyncio.sleep(0.03)
        await d.stop_routing([1])
        await d.redispatch(await d.abort_inflight([1]), [0])
        await delivered(out, 6)

    out, manifest = accounted(scenario, Workers(), [f"r{i}" for i in range(6)], 60)
    report = manifest.report()
    assert report.ok, report.violations
    assert len(out) == 6 and any(s.metadata[RESUMED] for s in out)


def test_rlinf_303_a_resumed_sequence_at_its_limit_is_not_returned_twice() -> None:
    """The engine aborts every request exactly as its last token comes out: each partial
    is at its length limit, so re-dispatching it would return the sequence twice."""

    class AtLimit(Workers):
        async def serve(self, device: int, item: Any, *, deadline_s: float) -> Sample:
            sample = await super().serve(device, item, deadline_s=deadline_s)
            return msgspec.structs.replace(sample, metadata={**sample.metadata, FINISH: "abort"})

    workers = AtLimit()

    async def scenario(d: Dispatcher, w: Workers, roles: Roles, out: list[Sample]) -> None:
        d.add_worker(0)
        d.submit(requests(3, length=4))
        await delivered(out, 3)
        await asyncio.sleep(0.05)  # a second (wrong) delivery would arrive by now

    out, manifest = accounted(scenario, workers, ["r0", "r1", "r2"], 4)
    assert sorted(s.sample_id for s in out) == ["r0", "r1", "r2"] and workers.served[0] == 3
    assert manifest.report().ok, manifest.report().violations
    # The same events with the bug (the at-limit partial dispatched again) are caught.
    buggy = Manifest()
    buggy.issue("r0", 0, max_tokens=4)
    buggy.abort("r0", buggy.dispatch("r0"), num_tokens=4)
    buggy.generated("r0", buggy.dispatch("r0"), num_tokens=4)
    buggy.generated("r0", 2, num_tokens=4)
    kinds = {v.kind for v in buggy.report().violations}
    assert {"redispatch_at_limit", "duplicate_generation"} <= kinds


class CachingWorkers(Workers):
    """Workers whose engine reports ``cached_tokens`` as an ideal block cache would: the
    longest whole-block prefix of the prompt that a finished sequence shared, never the
    prompt's last token nor the sequence's (whose KV was never computed; ample capacity:
    nothing is evicted)."""

    BLOCK = 4

    def __init__(self) -> None:
        super().__init__()
        self.finished: list[list[int]] = []
        self.order: list[str] = []

    async def serve(self, device: int, item: Any, *, deadline_s: float) -> Sample:
        self.order.append(item.sample_id)
        prompt = [int(t) for t in unpack_tokens(item.token_ids)]
        shared = max((_common(prompt[:-1], seq) for seq in self.finished), default=0)
        result = await super().serve(device, item, deadline_s=deadline_s)
        self.finished.append([int(t) for t in unpack_tokens(result.token_ids)][:-1])
        cached = shared // self.BLOCK * self.BLOCK
        return msgspec.structs.replace(
            result, metadata={**result.metadata, "cached_tokens": cached}
        )


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("policy", ["priority", "fifo"])
def test_the_cache_shadow_puts_a_cached_prefix_first_and_predicts_the_engine(policy: str) -> None:
    from dynarl.sched import FifoPolicy, PrefixCache, PriorityPolicy

    workers = CachingWorkers()

    def request(sample_id: str, prompt: list[int], length: int) -> GenerationRequest:
        return GenerationRequest(
            sample_id=sample_id, token_ids=pack_tokens(prompt), max_new_tokens=length
        )

    async def scenario(d: Dispatcher, w: Workers, roles: Roles, out: list[Sample]) -> None:
        d.add_worker(0)
        d.submit([request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 7)])
        await delivered(out, 1)
        context = [int(t) for t in unpack_tokens(out[0].token_ids)]
        d.submit([request("x", [50, 51, 52], 30)])  # holds the only slot a while
        await asyncio.sleep(0.01)
        d.submit([request("b", [60, 61, 62, 63, 64, 65, 66, 67, 68], 3)])  # nothing cached
        d.submit([request("c", [*context, 70, 71], 3)])  # a's first 12 of 16 tokens cached
        await delivered(out, 4)

    async def main() -> tuple[list[Sample], Dispatcher]:
        out: list[Sample] = []

        async def sink(sample: Sample) -> None:
            out.append(sample)

        dispatcher = Dispatcher(
            "rollout", link=workers, roles=Roles(), output=sink,  # type: ignore[arg-type]
            max_inflight=1, item_timeout_s=30.0, drain_timeout_s=5.0,
            policy=PriorityPolicy() if policy == "priority" else FifoPolicy(),
            prefix_cache=PrefixCache(block_size=CachingWorkers.BLOCK, capacity_blocks=1000),
        )  # fmt: skip
        stop = asyncio.Event()
        async with asyncio.timeout(30), asyncio.TaskGroup() as group:
            group.create_task(dispatcher.run(stop))
            await asyncio.sleep(0)
            await scenario(dispatcher, workers, Roles(), out)
            stop.set()
        return out, dispatcher

    out, dispatcher = asyncio.run(main())
    assert workers.order == (["a", "x", "c", "b"] if policy == "priority" else ["a", "x", "b", "c"])
    c = next(s for s in out if s.sample_id == "c")
    assert c.metadata["cached_tokens"] == 12
    assert dispatcher.shadows is not None
    check = dispatcher.shadows.check
    assert check.predictions == 4 and check.exact == 4 and check.abs_error_tokens == 0
