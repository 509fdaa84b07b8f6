"""``ComputeMeter``: what a trainer role reports as its metrics — the busy share of its
compute thread since the last reading, the micro-batches it finished, the ones it still has
queued. Thread-safe: the compute thread accounts, the worker's loop reads. Shared by the
reference and the Megatron trainer roles.
"""

from __future__ import annotations

import threading
import time

from dynarl.runtime.worker import RoleMetrics

__all__ = ["ComputeMeter"]


class ComputeMeter:
    """Busy time of one compute thread between readings (:meth:`reading`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy_s = 0.0
        self._since = time.perf_counter()
        self._running: float | None = None
        self._completed = 0
        self._queued = 0

    def begin(self, queued: int = 0) -> float:
        """A piece of work starts now, with ``queued`` items ahead; its start time."""
        with self._lock:
            self._running = time.perf_counter()
            self._queued = queued
            return self._running

    def queue(self, items: int) -> None:
        """``items`` are queued in the work under way."""
        with self._lock:
            self._queued = items

    def dequeue(self) -> None:
        """One queued item is done."""
        with self._lock:
            self._queued -= 1

    def account(self, began: float, done: int) -> None:
        """The work begun at ``began`` ended, finishing ``done`` items."""
        with self._lock:
            self._busy_s += time.perf_counter() - max(began, self._since)
            self._running = None
            self._completed += done
            self._queued = 0

    def reading(self) -> RoleMetrics:
        """Busy share since the last reading (work under way counted up to now), items
        finished since then, items queued now."""
        with self._lock:
            now = time.perf_counter()
            span = max(now - self._since, 1e-6)
            busy = self._busy_s
            if self._running is not None:
                busy += now - max(self._running, self._since)
            self._busy_s, self._since = 0.0, now
            done, self._completed = self._completed, 0
            queued = self._queued
        return RoleMetrics(
            utilization=min(1.0, busy / span),
            queue_depth=queued,
            in_flight=1 if queued else 0,
            completed=done,
        )
