"""Dispatcher: the serving path of a rollout, inference, reward or tool component.

Submitted items (``GenerationRequest`` or ``Sample``) are routed by the scheduler's
:class:`~dynarl.sched.DataRouter` (affinity, priority queue per worker) and sent to the
workers, at most ``max_inflight`` per worker, each as one bus request whose reply is the
result. A result whose metadata says ``finish == "abort"`` is a partial output: its tokens
are kept and the item continues as a new request (original prompt plus everything
generated so far, the remaining token budget, absolute positions in ``prompt_len``) — or
is final when nothing of its budget is left, so a generation that was already complete
is never returned twice. Every item is delivered exactly once to the output sink.

The dispatcher is the :class:`~dynarl.migrate.WorkloadHost` of the component's workload
migrations: ``stop_routing`` takes workers out of the router (their queued items go to
the others), ``abort_inflight`` collects their partial outputs, ``redispatch`` routes the
continuations with priority and affinity kept (parked when no worker is left),
``release`` / ``resume`` deactivate and reactivate their roles. Runs on the controller's
event loop (in the component's group manager).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from dynarl.bus.messages import GenerationRequest, MetaValue, Sample, pack_tokens, unpack_tokens
from dynarl.errors import BusError, PeerLostError, WorkerError
from dynarl.migrate.workload import PartialRequest
from dynarl.runtime.link import WorkerLink
from dynarl.runtime.wire import FINISH, PROMPT_LEN, RESUMED, AbortInflight, Done
from dynarl.sched.graph import Affinity
from dynarl.sched.requests import RequestPolicy
from dynarl.sched.router import DataRouter, RoutedItem

__all__ = ["Dispatcher", "Item", "WorkerRoles"]

logger = logging.getLogger(__name__)

Item = GenerationRequest | Sample
"""What a serving component takes."""
Sink = Callable[[Sample], Coroutine[Any, Any, None]]

_MAX_FAILURES = 3


class WorkerRoles(Protocol):
    """Starts and stops the component's role on workers (the group manager)."""

    async def activate(self, devices: Sequence[int]) -> None:
        """Make the component's role active on ``devices`` (wake it, or create it)."""
        ...

    async def release(self, devices: Sequence[int]) -> None:
        """Stop it there and free its memory (asleep or torn down)."""
        ...


@dataclass(slots=True)
class _Pending:
    original: Item
    routed: RoutedItem
    generated: list[int] = field(default_factory=list)
    logprobs: bytes = b""
    resumed: int = 0
    failures: int = 0
    worker: int | None = None


class Dispatcher:
    """The serving path of one component (see the module docstring)."""

    def __init__(
        self,
        component: str,
        *,
        link: WorkerLink,
        roles: WorkerRoles,
        output: Sink,
        max_inflight: int,
        item_timeout_s: float,
        drain_timeout_s: float,
        policy: RequestPolicy | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.component = component
        self._link, self._roles, self._output = link, roles, output
        self.max_inflight = max_inflight
        self.item_timeout_s, self.drain_timeout_s = item_timeout_s, drain_timeout_s
        self.router = DataRouter((), policy=policy)
        self._items: dict[str, _Pending] = {}
        self._parked: list[str] = []
        self._inflight: dict[int, set[str]] = {}
        self._draining: set[int] = set()
        self._released: set[int] = set()
        self._drained: dict[int, list[str]] = {}
        self._changed = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_delivered = 0
        self.num_resumed = 0

    # ------------------------------------------------------------------ life cycle

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; in-flight requests are then cancelled."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            self._pump()
            await stop.wait()
            self._group = None
            for task in list(self._tasks):
                task.cancel()

    @property
    def workers(self) -> tuple[int, ...]:
        """Workers routed to now."""
        return self.router.workers

    @property
    def queue_depth(self) -> int:
        """Items waiting (queued at a worker or parked)."""
        queued = sum(len(self.router.queued(w)) for w in self.router.workers)
        return queued + len(self._parked)

    @property
    def remaining(self) -> int:
        """Items submitted and not delivered yet (queued, parked or in flight)."""
        return len(self._items)

    def add_worker(self, device: int) -> None:
        """Route to ``device`` (its role is active); parked items go out at once."""
        if device not in self.router.workers:
            self.router.add_worker(device)
            self._inflight.setdefault(device, set())
        self._draining.discard(device)
        self._released.discard(device)
        parked, self._parked = self._parked, []
        self._route(parked)

    def submit(self, items: Sequence[Item]) -> None:
        """Accept ``items`` (delivered later to the output sink).

        Raises ValueError for an id already in the dispatcher or repeated in ``items``.
        """
        ids = [_item_id(item) for item in items]
        clash = {i for i in ids if i in self._items or ids.count(i) > 1}
        if clash:
            raise ValueError(f"{self.component}: items {sorted(clash)[:5]} are already submitted")
        for item, item_id in zip(items, ids, strict=True):
            self._items[item_id] = _Pending(original=item, routed=_routed(item_id, item))
        self._route(ids)

    # ------------------------------------------------------------------ routing

    def _route(self, ids: Sequence[str]) -> None:
        if not ids:
            return
        if not self.router.workers:
            self._parked.extend(ids)
            return
        routing = self.router.distribute_data([self._items[i].routed for i in ids])
        for item_id, reason in routing.unroutable:
            logger.info("%s: %s parked (%s)", self.component, item_id, reason)
            self._parked.append(item_id)
        self._pump()

    def _pump(self) -> None:
        if self._group is None:
            return
        for worker in self.router.workers:
            if worker in self._draining:
                continue
            running = self._inflight.setdefault(worker, set())
            for queued in self.router.priority_schedule(worker, self.max_inflight - len(running)):
                running.add(queued.request_id)
                self._items[queued.request_id].worker = worker
                self._spawn(self._send(worker, queued.request_id))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        assert self._group is not None
        task = self._group.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, worker: int, item_id: str) -> None:
        pending = self._items[item_id]
        result: Sample | Exception
        try:
            result = await self._link.serve(
                worker, _next_request(pending), deadline_s=self.item_timeout_s
            )
        except (BusError, WorkerError) as exc:
            result = exc
        self._inflight.get(worker, set()).discard(item_id)
        self.router.done(worker, item_id)
        pending.worker = None
        self._changed.set()
        if isinstance(result, Exception):
            self._failed(worker, item_id, result)
            self._pump()
            return
        final = _absorb(pending, result)
        if final is not None:
            del self._items[item_id]
            self.num_delivered += 1
            await self._output(final)
        elif worker in self._draining:
            self._drained.setdefault(worker, []).append(item_id)
        else:
            self._route([item_id])
        self._pump()

    def _failed(self, worker: int, item_id: str, exc: Exception) -> None:
        pending = self._items[item_id]
        pending.failures += 1
        logger.warning("%s: item %s failed on worker %d: %r", self.component, item_id, worker, exc)
        if isinstance(exc, PeerLostError) and worker in self.router.workers:
            self._route([r.request_id for r in self.router.remove_worker(worker)])
        if worker in self._draining:
            self._drained.setdefault(worker, []).append(item_id)
        elif pending.failures >= _MAX_FAILURES:
            logger.error(
                "%s: item %s failed %d times: delivered as an error",
                self.component,
                item_id,
                pending.failures,
            )
            self._fail_item(item_id, f"{type(exc).__name__}: {exc}")
        else:
            self._route([item_id])

    def _fail_item(self, item_id: str, why: str) -> None:
        pending = self._items.pop(item_id)
        sample = _final_sample(pending, None)
        meta = {**sample.metadata, FINISH: "error", "error": why[:200]}
        self.num_delivered += 1
        self._spawn(self._output(_with_metadata(sample, meta)))

    # ------------------------------------------------------------------ WorkloadHost

    async def stop_routing(self, workers: Sequence[int]) -> None:
        """Send nothing more to ``workers``; items queued for them go to the others."""
        moved: list[str] = []
        for worker in workers:
            self._draining.add(worker)
            if worker in self.router.workers:
                moved.extend(r.request_id for r in self.router.remove_worker(worker))
        self._route(moved)

    async def abort_inflight(self, workers: Sequence[int]) -> Sequence[PartialRequest]:
        """Abort what runs on ``workers`` and return it with its partial outputs.

        Raises TimeoutError if their requests do not come back within
        ``drain_timeout_s`` (they stay in flight, nothing is lost).
        """
        busy = [w for w in workers if self._inflight.get(w)]
        await self._link.ask_all(busy, AbortInflight(component=self.component), Done)
        async with asyncio.timeout(self.drain_timeout_s):
            while any(self._inflight.get(w) for w in workers):
                self._changed.clear()
                await self._changed.wait()
        return [
            _partial(item_id, self._items[item_id], worker)
            for worker in workers
            for item_id in self._drained.pop(worker, [])
        ]

    async def redispatch(self, requests: Sequence[PartialRequest], workers: Sequence[int]) -> None:
        """Route the drained ``requests`` to ``workers`` (parked if there is none)."""
        for request in requests:
            pending = self._items[request.request_id]
            pending.routed = _keep_context(pending.routed, request)
            self.num_resumed += 1
        allowed = set(workers) & set(self.router.workers)
        if allowed != set(self.router.workers):
            logger.info("%s: redispatch limited to %s", self.component, sorted(allowed))
        self._route([r.request_id for r in requests])

    async def release(self, workers: Sequence[int]) -> None:
        """Stop the role on ``workers`` and free its memory."""
        await self._roles.release(workers)
        self._released.update(workers)

    async def resume(self, workers: Sequence[int]) -> None:
        """Undo a move before commit: reactivate released roles, route to them again."""
        again = [w for w in workers if w in self._released]
        if again:
            await self._roles.activate(again)
        for worker in workers:
            self.add_worker(worker)
        self._pump()


# ---------------------------------------------------------------------- item helpers


def _item_id(item: Item) -> str:
    return item.sample_id


def _routed(item_id: str, item: Item) -> RoutedItem:
    meta = item.metadata
    affinity = str(meta.get("affinity", "none"))
    return RoutedItem(
        item_id=item_id,
        episode=str(meta.get("episode", item.prompt_id or item_id)),
        affinity=Affinity(affinity) if affinity in Affinity.__members__.values() else Affinity.NONE,
        status=_int(meta.get("tool_calls")),
        cached_prefix=_int(meta.get("cached_prefix")),
    )


def _int(value: MetaValue) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _keep_context(routed: RoutedItem, request: PartialRequest) -> RoutedItem:
    # The donor worker is gone: a "must" affinity can only become a preference now.
    affinity = Affinity.PREFER if routed.affinity is Affinity.MUST else routed.affinity
    return RoutedItem(
        item_id=routed.item_id,
        episode=routed.episode,
        affinity=affinity,
        status=routed.status,
        cached_prefix=0,
        attained_service=float(len(request.generated)),
    )


def _partial(item_id: str, pending: _Pending, worker: int) -> PartialRequest:
    prompt: tuple[int, ...] = ()
    if isinstance(pending.original, GenerationRequest):
        prompt = tuple(int(t) for t in unpack_tokens(pending.original.token_ids))
    return PartialRequest(
        request_id=item_id,
        prompt=prompt,
        generated=tuple(pending.generated),
        priority=(float(pending.routed.status), float(pending.routed.cached_prefix)),
        affinity=str(pending.routed.affinity),
        affinity_worker=worker,
    )


def _next_request(pending: _Pending) -> Item:
    """What to send next: the original, or its continuation after a partial output."""
    original = pending.original
    if not isinstance(original, GenerationRequest) or not pending.resumed:
        return original
    prompt = unpack_tokens(original.token_ids)
    tokens = [*prompt.tolist(), *pending.generated]
    meta = {**original.metadata, PROMPT_LEN: len(prompt), RESUMED: pending.resumed}
    return GenerationRequest(
        sample_id=original.sample_id,
        token_ids=pack_tokens(tokens),
        max_new_tokens=original.max_new_tokens - len(pending.generated),
        prompt_id=original.prompt_id,
        temperature=original.temperature,
        top_p=original.top_p,
        seed=original.seed,
        priority=original.priority,
        metadata=meta,
    )


def _absorb(pending: _Pending, result: Sample) -> Sample | None:
    """Fold a worker's result into the item; the final sample, or None if it continues."""
    if result.metadata.get(FINISH) != "abort":
        return _final_sample(pending, result)
    original = pending.original
    if not isinstance(original, GenerationRequest):
        return None  # nothing partial to keep: the original item runs again
    tokens = unpack_tokens(result.token_ids)[result.prompt_len :]
    pending.generated.extend(int(t) for t in tokens)
    pending.logprobs += result.logprobs
    pending.resumed += 1
    if len(pending.generated) >= original.max_new_tokens:
        final = _final_sample(pending, None)
        return _with_metadata(final, {**result.metadata, **final.metadata, FINISH: "length"})
    return None


def _final_sample(pending: _Pending, result: Sample | None) -> Sample:
    original = pending.original
    if not isinstance(original, GenerationRequest):
        return result if result is not None else original
    prompt = unpack_tokens(original.token_ids)
    generated = list(pending.generated)
    logprobs = pending.logprobs
    meta: dict[str, MetaValue] = dict(original.metadata)
    reward, version = None, 0
    if result is not None:
        generated += unpack_tokens(result.token_ids)[result.prompt_len :].tolist()
        logprobs += result.logprobs
        meta.update(result.metadata)
        reward, version = result.reward, result.policy_version
    meta.pop(PROMPT_LEN, None)
    meta[RESUMED] = pending.resumed
    return Sample(
        sample_id=original.sample_id,
        token_ids=pack_tokens([*prompt.tolist(), *generated]),
        prompt_len=len(prompt),
        prompt_id=original.prompt_id,
        reward=reward,
        logprobs=logprobs,
        policy_version=version,
        metadata=meta,
    )


def _with_metadata(sample: Sample, metadata: dict[str, MetaValue]) -> Sample:
    return msgspec.structs.replace(sample, metadata=metadata)
