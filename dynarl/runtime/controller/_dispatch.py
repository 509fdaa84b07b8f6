"""Dispatcher: the serving path of a rollout, inference, reward or tool component.

Submitted items (``GenerationRequest`` or ``Sample``) are routed by the scheduler's
:class:`~dynarl.sched.DataRouter` (affinity, priority queue per worker) and sent to the
workers, at most ``max_inflight`` per worker, each as one bus request whose reply is the
result. A result whose metadata says ``finish == "abort"`` is a partial output: its tokens
are kept and the item continues as a new request (original prompt plus everything
generated so far, the remaining token budget, absolute positions in ``prompt_len``) — or
is final when nothing of its budget is left, so a generation that was already complete
is never returned twice. Every item is delivered exactly once to the output sink.

The dispatcher is the :class:`~dynarl.migrate._drain.WorkloadHost` of the component's workload
migrations: ``stop_routing`` takes workers out of the router (their queued items go to
the others), ``abort_inflight`` collects their partial outputs, ``redispatch`` routes the
continuations with priority and affinity kept (parked when no worker is left),
``release`` / ``resume`` deactivate and reactivate their roles. Runs on the controller's
event loop (in the component's group manager).

A worker that dies outside a migration: a request that cannot reach it names it to the
job's :class:`~dynarl.runtime.controller._losses.Losses` as a suspect; once the controller
confirms the loss (:meth:`Dispatcher.lose_worker`) nothing more is routed there, its
queued items go to the others and its in-flight ones follow as their requests fail, none
of it counted against the item. The forced reclaim of its device then runs as a workload
migration that skips the dead worker (nothing to abort or release there).

With an :class:`SampleAccounting` attached (``dispatcher.accounting``, e.g. the job's
:class:`~dynarl.runtime.durable.Manifest`), every attempt is reported: ``dispatch``
before each request, ``abort`` for a partial output or a failed request (with the tokens
generated so far), ``generated`` once for the final output.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from dynarl.bus import Sample, unpack_tokens
from dynarl.errors import BusError, PeerLostError, WorkerError
from dynarl.migrate import PartialRequest
from dynarl.runtime._worker_protocol import AbortInflight, Done
from dynarl.runtime.controller._cache_shadows import CacheShadows
from dynarl.runtime.controller._link import WorkerLink
from dynarl.runtime.controller._losses import Losses
from dynarl.runtime.controller._progress import Item, Progress
from dynarl.sched import DataRouter, PrefixCache, QueuedRequest, RequestPolicy

__all__ = ["Dispatcher", "SampleAccounting", "WorkerRoles"]

logger = logging.getLogger(__name__)

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


class SampleAccounting(Protocol):
    """Told of every generation attempt (what :class:`~dynarl.runtime.durable.Manifest` does)."""

    def dispatch(self, sample_id: str) -> int:
        """An attempt starts; its number."""
        ...

    def abort(self, sample_id: str, attempt: int, *, num_tokens: int) -> None:
        """The attempt ended without the final output (``num_tokens`` generated so far)."""
        ...

    def generated(self, sample_id: str, attempt: int, *, num_tokens: int) -> None:
        """The attempt produced the final output."""
        ...


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
        losses: Losses | None = None,
        max_overtakes: int | None = 64,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """``losses``: the job's worker losses (None: this dispatcher never hears of one)."""
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.component = component
        self._link, self._roles, self._output = link, roles, output
        self.max_inflight = max_inflight
        self.item_timeout_s, self.drain_timeout_s = item_timeout_s, drain_timeout_s
        self.router = DataRouter((), policy=policy, max_overtakes=max_overtakes)
        self._items: dict[str, Progress] = {}
        self._parked: list[str] = []
        self._inflight: dict[int, set[str]] = {}
        self._draining: set[int] = set()
        self._released: set[int] = set()
        self._drained: dict[int, list[str]] = {}
        self._losses = losses
        self._lost: set[int] = set()
        self._changed = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_delivered = 0
        self.num_resumed = 0
        self.accounting: SampleAccounting | None = None
        """Told of every generation attempt, when set."""
        self.shadows = CacheShadows(prefix_cache) if prefix_cache is not None else None
        """The engines' prefix caches, modelled: the cached-prefix term of the request key
        (None: the items' own metadata)."""

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
        """Route to ``device`` (its role is active): it takes its share of what waits at
        the other workers (:meth:`DataRouter.share_with`), and parked items go out at once."""
        if device not in self.router.workers:
            self.router.add_worker(device)
            self._inflight.setdefault(device, set())
            shared = self.router.share_with(device, lambda item_id: self._items[item_id].routed)
            if shared:
                logger.info("%s: %d waiting items moved to %d", self.component, len(shared), device)
                if self.shadows is not None:
                    for worker in self.router.workers:
                        self.shadows.rekey(self.router, worker, self._items)
        self._draining.discard(device)
        self._released.discard(device)
        self._lost.discard(device)
        parked, self._parked = self._parked, []
        self._route(parked)
        self._pump()

    def submit(self, items: Sequence[Item]) -> None:
        """Accept ``items`` (delivered later to the output sink).

        Raises ValueError for an id already in the dispatcher or repeated in ``items``,
        the fatal WorkerLostError once the job cannot go on.
        """
        if self._losses is not None:
            self._losses.raise_if_failed()
        ids = [item.sample_id for item in items]
        clash = {i for i in ids if i in self._items or ids.count(i) > 1}
        if clash:
            raise ValueError(f"{self.component}: items {sorted(clash)[:5]} are already submitted")
        for item, item_id in zip(items, ids, strict=True):
            self._items[item_id] = Progress(original=item)
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
        if self.shadows is not None:
            for worker, _ in routing.assignment:
                self.shadows.rekey(self.router, worker, self._items)
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
                if self.shadows is not None:
                    self.shadows.dispatched(worker, self._items[queued.request_id])
                self._spawn(self._send(worker, queued.request_id))

    def _unroute(self, worker: int) -> list[QueuedRequest]:
        """Stop routing to ``worker``: its queued requests, its cache shadow forgotten."""
        if self.shadows is not None:
            self.shadows.forget(worker)
        return self.router.remove_worker(worker)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        assert self._group is not None
        task = self._group.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, worker: int, item_id: str) -> None:
        pending = self._items[item_id]
        accounting = self.accounting
        attempt = accounting.dispatch(item_id) if accounting is not None else 0
        result: Sample | Exception
        try:
            result = await self._link.serve(
                worker, pending.next_request(), deadline_s=self.item_timeout_s
            )
        except (BusError, WorkerError) as exc:
            result = exc
        self._inflight.get(worker, set()).discard(item_id)
        self.router.done(worker, item_id)
        self._changed.set()
        if self.shadows is not None:
            self.shadows.ended(worker, pending, None if isinstance(result, Exception) else result)
            if worker in self.router.workers:
                self.shadows.rekey(self.router, worker, self._items)
        if isinstance(result, Exception):
            if accounting is not None:
                accounting.abort(item_id, attempt, num_tokens=len(pending.generated))
            self._failed(worker, item_id, result)
            self._pump()
            return
        final = pending.absorb(result)
        if accounting is not None:
            if final is None:
                accounting.abort(item_id, attempt, num_tokens=len(pending.generated))
            else:
                accounting.generated(item_id, attempt, num_tokens=_response_tokens(final))
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
        if self._losses is not None and _unreachable(exc) and not self._is_lost(worker):
            self._losses.suspect(worker, cause=f"unreachable: {exc}")
            self._losses.judge_now()  # a dead worker is known lost before the item moves on
        if self._is_lost(worker):  # not the item's fault: it continues elsewhere
            logger.info("%s: item %s leaves lost worker %d", self.component, item_id, worker)
        else:
            pending.failures += 1
            logger.warning(
                "%s: item %s failed on worker %d: %r", self.component, item_id, worker, exc
            )
        if isinstance(exc, PeerLostError) and worker in self.router.workers:
            self._route([r.request_id for r in self._unroute(worker)])
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

    def _is_lost(self, worker: int) -> bool:
        return worker in self._lost or (self._losses is not None and self._losses.is_lost(worker))

    def lose_worker(self, device: int) -> None:
        """``device``'s worker died: route nothing more to it; its queued items go to the
        others (parked if none is left), its in-flight ones follow as their requests fail."""
        self._lost.add(device)
        if device in self.router.workers:
            self._route([r.request_id for r in self._unroute(device)])
        self._changed.set()

    def _fail_item(self, item_id: str, why: str) -> None:
        sample = self._items.pop(item_id).failed(why)
        self.num_delivered += 1
        self._spawn(self._output(sample))

    # ------------------------------------------------------------------ WorkloadHost

    async def stop_routing(self, workers: Sequence[int]) -> None:
        """Send nothing more to ``workers``; items queued for them go to the others."""
        moved: list[str] = []
        for worker in workers:
            self._draining.add(worker)
            if worker in self.router.workers:
                moved.extend(r.request_id for r in self._unroute(worker))
        self._route(moved)

    async def abort_inflight(self, workers: Sequence[int]) -> Sequence[PartialRequest]:
        """Abort what runs on ``workers`` and return it with its partial outputs.

        Raises TimeoutError if their requests do not come back within
        ``drain_timeout_s`` (they stay in flight, nothing is lost).
        """
        busy = [w for w in workers if self._inflight.get(w) and not self._is_lost(w)]
        await self._link.ask_all(busy, AbortInflight(component=self.component), Done)
        async with asyncio.timeout(self.drain_timeout_s):
            while any(self._inflight.get(w) for w in workers):
                self._changed.clear()
                await self._changed.wait()
        return [
            self._items[item_id].partial(worker)
            for worker in workers
            for item_id in self._drained.pop(worker, [])
        ]

    async def redispatch(self, requests: Sequence[PartialRequest], workers: Sequence[int]) -> None:
        """Route the drained ``requests`` to ``workers`` (parked if there is none)."""
        for request in requests:
            pending = self._items[request.request_id]
            pending.continue_elsewhere()
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
        """Undo a move before commit: reactivate released roles, route to them again
        (a worker lost meanwhile stays out) and route the items its drain left behind."""
        # Items that failed on a draining worker wait for the redispatch step; a move
        # undone before it (its drain failed) routes them now.
        stranded = [i for w in workers for i in self._drained.pop(w, []) if i in self._items]
        workers = [w for w in workers if not self._is_lost(w)]
        again = [w for w in workers if w in self._released]
        if again:
            await self._roles.activate(again)
        for worker in workers:
            self.add_worker(worker)
        for item_id in stranded:
            self._items[item_id].continue_elsewhere()
        self._route(stranded)
        self._pump()


def _unreachable(exc: Exception) -> bool:
    """Whether ``exc`` says the worker could not be reached (gone, or its connection)."""
    return isinstance(exc, PeerLostError) or type(exc) is BusError


def _response_tokens(sample: Sample) -> int:
    return max(0, len(unpack_tokens(sample.token_ids)) - sample.prompt_len)
