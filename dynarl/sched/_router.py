"""The DataRouter of a worker group: where each item goes, and in which order it runs.

Every item carries a context: ``affinity`` (must / prefer / none go back to the worker
that last handled its episode, whose prefix cache holds its context) and ``status``
(steps the episode has done). :meth:`DataRouter.distribute_data` picks a worker per item
— the sticky worker for ``must``; for ``prefer`` the sticky one unless it is more than
``prefer_slack`` items busier than the least-loaded worker; otherwise the least-loaded,
lowest index first — and queues it there. :meth:`DataRouter.priority_schedule` pops the
next batch of one worker's queue (see :mod:`dynarl.sched._requests`). Removing a worker
(a migration took its device) hands back everything queued on it, so nothing is lost;
adding one lets it take its share of the others' backlog (:meth:`DataRouter.share_with`).
Affinities are kept for the ``max_episodes`` most recently routed episodes (older ones are
forgotten, so a long job's router stays bounded). Lives in the group manager's loop; not
thread-safe.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from dynarl.sched._graph import Affinity
from dynarl.sched._requests import QueuedRequest, RequestPolicy, RequestQueue

__all__ = ["DataRouter", "RoutedItem", "Routing"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutedItem:
    """One item to route, with its context."""

    item_id: str
    """Unique id (one request / turn)."""
    episode: str
    """The episode (sequence) it belongs to: the key of its worker affinity."""
    affinity: Affinity = Affinity.NONE
    """Whether it must, should or need not go back to its episode's last worker."""
    status: int = 0
    """Steps (tool calls) its episode has completed."""
    cached_prefix: int = 0
    """Reusable prefix tokens on its sticky worker, if known."""
    attained_service: float = 0.0
    """Tokens its episode has generated so far."""
    tool_ok: bool = True
    """Whether its episode's last tool call succeeded."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Routing:
    """Where :meth:`DataRouter.distribute_data` put each item."""

    assignment: tuple[tuple[int, tuple[str, ...]], ...]
    """(worker, item ids) pairs, by worker."""
    unroutable: tuple[tuple[str, str], ...] = ()
    """(item id, reason) for items that could not be placed; they were not queued."""


class DataRouter:
    """Per-group router over per-worker :class:`RequestQueue` s.

    Raises ValueError for an unknown worker or a worker added twice.
    """

    def __init__(
        self,
        workers: Iterable[int],
        *,
        policy: RequestPolicy | None = None,
        max_overtakes: int | None = 64,
        prefer_slack: int = 4,
        max_episodes: int = 65_536,
    ) -> None:
        if prefer_slack < 0:
            raise ValueError(f"prefer_slack must be >= 0, got {prefer_slack}")
        if max_episodes < 1:
            raise ValueError(f"max_episodes must be >= 1, got {max_episodes}")
        self._policy = policy
        self._max_overtakes = max_overtakes
        self.prefer_slack = prefer_slack
        self._queues: dict[int, RequestQueue] = {}
        self._overtakes_of_removed = 0
        self._in_flight: dict[int, set[str]] = {}
        self.max_episodes = max_episodes
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._status: OrderedDict[str, int] = OrderedDict()
        for worker in workers:
            self.add_worker(worker)

    @property
    def workers(self) -> tuple[int, ...]:
        """Workers that accept items, ascending."""
        return tuple(sorted(self._queues))

    @property
    def max_overtakes_seen(self) -> int:
        """The most overtakes any item dispatched from a worker's queue suffered (workers
        removed since included)."""
        return max(
            [self._overtakes_of_removed, *(q.max_overtakes_seen for q in self._queues.values())]
        )

    def add_worker(self, worker: int) -> None:
        """Start routing to ``worker``."""
        if worker in self._queues:
            raise ValueError(f"worker {worker} is already routed to")
        self._queues[worker] = RequestQueue(self._policy, max_overtakes=self._max_overtakes)
        self._in_flight[worker] = set()

    def share_with(self, worker: int, context: Callable[[str], RoutedItem]) -> list[str]:
        """Give ``worker`` (one that just joined) its share of the others' backlog: from
        each worker holding more than ``prefer_slack`` items beyond it, the queued requests
        it would run last (the largest keys; the latest arrival among equals; never one
        that must stay), until the two are within the slack — where routing them now would
        have put them. They run
        without their cached prefix there (its cache holds nothing of theirs) and their
        episodes stick to ``worker`` from now on. ``context``: a queued id's item. Returns
        the ids moved; they queue at ``worker`` in their arrival order."""
        target = self._queue(worker)
        moved: list[QueuedRequest] = []
        for other in self.workers:
            if other == worker:
                continue
            queue = self._queues[other]
            last_first = sorted(queue, key=lambda r: (queue.policy.key(r), r.seq), reverse=True)
            for request in last_first:
                if self.load(other) <= self.load(worker) + len(moved) + self.prefer_slack:
                    break
                if context(request.request_id).affinity is not Affinity.MUST:
                    moved.append(queue.remove(request.request_id))
        for request in sorted(moved, key=lambda r: r.seq):
            item = context(request.request_id)
            target.push(replace(request, cached_prefix=0))
            self._remember(item.episode, worker, item.status)
        return [r.request_id for r in moved]

    def remove_worker(self, worker: int) -> list[QueuedRequest]:
        """Stop routing to ``worker``; returns its queued requests, in arrival order.

        Its in-flight items stay recorded until :meth:`done`; affinities to it are dropped.
        """
        queue = self._queue(worker)
        left = list(queue)
        self._overtakes_of_removed = max(self._overtakes_of_removed, queue.max_overtakes_seen)
        del self._queues[worker]
        self._in_flight.pop(worker, None)
        self._sticky = OrderedDict((e, w) for e, w in self._sticky.items() if w != worker)
        return left

    def clear_sticky(self) -> None:
        """Forget every affinity (rebalancing after replicas were added)."""
        self._sticky.clear()

    def load(self, worker: int) -> int:
        """Items queued on or running at ``worker``."""
        return len(self._queue(worker)) + len(self._in_flight.get(worker, ()))

    def status(self, episode: str) -> tuple[int | None, int]:
        """(last worker, steps done) of ``episode``."""
        return self._sticky.get(episode), self._status.get(episode, 0)

    def distribute_data(self, items: Sequence[RoutedItem]) -> Routing:
        """Queue each item on a worker (see the module docstring)."""
        heap = [(self.load(w), w) for w in self._queues]
        heapq.heapify(heap)
        loads = {w: load for load, w in heap}
        placed: dict[int, list[str]] = {}
        unroutable: list[tuple[str, str]] = []
        for item in items:
            worker, reason = self._choose(item, heap, loads)
            if worker is None:
                unroutable.append((item.item_id, reason))
                continue
            self._queues[worker].push(
                QueuedRequest(
                    request_id=item.item_id,
                    tool_calls=item.status,
                    cached_prefix=item.cached_prefix
                    if self._sticky.get(item.episode) == worker
                    else 0,
                    attained_service=item.attained_service,
                    tool_ok=item.tool_ok,
                )
            )
            loads[worker] += 1
            heapq.heappush(heap, (loads[worker], worker))
            self._remember(item.episode, worker, item.status)
            placed.setdefault(worker, []).append(item.item_id)
        return Routing(
            assignment=tuple((w, tuple(ids)) for w, ids in sorted(placed.items())),
            unroutable=tuple(unroutable),
        )

    def _remember(self, episode: str, worker: int, status: int) -> None:
        for table, value in ((self._sticky, worker), (self._status, status)):
            table[episode] = value
            table.move_to_end(episode)
            while len(table) > self.max_episodes:
                table.popitem(last=False)

    def _choose(
        self, item: RoutedItem, heap: list[tuple[int, int]], loads: Mapping[int, int]
    ) -> tuple[int | None, str]:
        sticky = self._sticky.get(item.episode)
        if item.affinity is Affinity.MUST:
            if sticky is None:
                return None, f"must-affinity episode {item.episode!r} has no previous worker"
            return sticky, ""
        while heap and heap[0][0] != loads.get(heap[0][1]):
            heapq.heappop(heap)  # stale entry
        if not heap:
            return None, "no worker accepts items"
        least_load, least = heap[0]
        if (
            item.affinity is Affinity.PREFER
            and sticky is not None
            and loads[sticky] <= least_load + self.prefer_slack
        ):
            return sticky, ""
        return least, ""

    def priority_schedule(self, worker: int, max_items: int) -> list[QueuedRequest]:
        """The next ``max_items`` requests of ``worker``'s queue; they become in flight."""
        batch = self._queue(worker).pop_batch(max_items)
        self._in_flight[worker].update(r.request_id for r in batch)
        return batch

    def done(self, worker: int, item_id: str) -> None:
        """``item_id`` finished (or was aborted) on ``worker``."""
        self._in_flight.get(worker, set()).discard(item_id)

    def evict(self, worker: int, cached_prefix: Mapping[str, int]) -> None:
        """``worker``'s cache evicted prefixes: re-key the affected queued requests."""
        self._queue(worker).evict(cached_prefix)

    def queued(self, worker: int) -> list[QueuedRequest]:
        """Requests waiting at ``worker``, in arrival order."""
        return list(self._queue(worker))

    def _queue(self, worker: int) -> RequestQueue:
        try:
            return self._queues[worker]
        except KeyError:
            raise ValueError(f"worker {worker} is not routed to") from None
