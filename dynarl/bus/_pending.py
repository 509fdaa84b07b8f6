"""The requests an endpoint waits on: their futures, their peers and their deadlines.

All deadlines share one timer (a heap of them, re-armed only when an earlier deadline
arrives): a timer per request costs more than the rest of a request's bookkeeping
together (``bench/bus.py``). Runs on the endpoint's event loop.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable
from typing import Any

from dynarl.bus._peers import Peer
from dynarl.errors import BusError, DeadlineExceeded

__all__ = ["PendingRequests"]

Entry = tuple[asyncio.Future[Any], Peer, float]


class PendingRequests:
    """Outstanding requests by id; expired ones fail with DeadlineExceeded.

    ``on_expire(peer, request_id)`` is called after a request's deadline passed and its
    future failed (the endpoint tells the peer to cancel).
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_expire: Callable[[Peer, int], None]
    ) -> None:
        self.waiting: dict[int, Entry] = {}
        """``request id → (future, peer, timeout seconds)``; the hot path reads it directly."""
        self._loop = loop
        self._on_expire = on_expire
        self._deadlines: list[tuple[float, int]] = []
        self._alarm: asyncio.TimerHandle | None = None
        self._alarm_at = math.inf

    def add(self, rid: int, future: asyncio.Future[Any], peer: Peer, seconds: float) -> None:
        """Wait on request ``rid`` to ``peer`` for at most ``seconds``."""
        self.waiting[rid] = (future, peer, seconds)
        deadline = self._loop.time() + seconds
        deadlines = self._deadlines
        heapq.heappush(deadlines, (deadline, rid))
        if deadline < self._alarm_at:
            self._rearm(deadline)
        if len(deadlines) > 2 * len(self.waiting) + 1024:  # drop the answered ones
            self._deadlines = [entry for entry in deadlines if entry[1] in self.waiting]
            heapq.heapify(self._deadlines)

    def _rearm(self, deadline: float) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
        self._alarm_at = deadline
        self._alarm = self._loop.call_at(deadline, self._sweep) if deadline < math.inf else None

    def _sweep(self) -> None:
        deadlines, now, waiting = self._deadlines, self._loop.time(), self.waiting
        while deadlines and (deadlines[0][0] <= now or deadlines[0][1] not in waiting):
            rid = heapq.heappop(deadlines)[1]
            entry = waiting.pop(rid, None)
            if entry is not None:
                future, peer, seconds = entry
                if not future.done():
                    future.set_exception(
                        DeadlineExceeded(f"no reply from {peer.name!r} within {seconds:g} s")
                    )
                self._on_expire(peer, rid)
        self._alarm = None
        self._rearm(deadlines[0][0] if deadlines else math.inf)

    def fail(self, peer: Peer | None, exc: BusError) -> None:
        """Fail the requests waiting on ``peer`` (on every peer if None) with ``exc``."""
        for rid, (future, target, _) in list(self.waiting.items()):
            if peer is None or target is peer:
                del self.waiting[rid]
                if not future.done():
                    future.set_exception(exc)

    def close(self, exc: BusError) -> None:
        """Fail every request with ``exc`` and stop the timer."""
        self.fail(None, exc)
        self._rearm(math.inf)
