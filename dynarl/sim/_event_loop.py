"""Virtual time: a discrete-event loop on the scheduler's ManualClock, and coroutine tasks.

:class:`EventLoop` keeps a heap of (time, order, callback); :meth:`EventLoop.run` pops
them in order and sets the shared :class:`~dynarl.sched.ManualClock` to each one's time
before calling it, so the scheduler, the hybrid controller and the model all read the
same virtual time. Ties run in scheduling order (deterministic).

Coroutines that ``await`` a :class:`Wait` (for a delay or for a condition another part
of the model signals) run as :class:`Task` s: the task steps the coroutine by hand
(``send``), so ``async`` code written for asyncio — such as
:class:`~dynarl.sched.HybridController` — runs in virtual time without an asyncio loop.
Nothing here sleeps or does I/O; single-threaded.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from dynarl.errors import DynarlError
from dynarl.sched import ManualClock

__all__ = ["EventLoop", "Handle", "Task", "Wait"]

logger = logging.getLogger(__name__)


class Handle:
    """A scheduled callback; :meth:`cancel` stops it from running."""

    __slots__ = ("callback", "cancelled", "time")

    def __init__(self, time: float, callback: Callable[[], None]) -> None:
        self.time = time
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        """Do not run the callback (a no-op once it ran)."""
        self.cancelled = True


class EventLoop:
    """Callbacks ordered by virtual time (see the module docstring)."""

    def __init__(self, clock: ManualClock | None = None) -> None:
        self.clock = clock if clock is not None else ManualClock()
        self._heap: list[tuple[float, int, Handle]] = []
        self._order = itertools.count()
        self.num_events = 0
        self.stopped = False

    @property
    def now(self) -> float:
        """The virtual time."""
        return self.clock.time

    def at(self, time: float, callback: Callable[[], None]) -> Handle:
        """Run ``callback`` at ``time`` (the present if ``time`` is past)."""
        handle = Handle(max(time, self.clock.time), callback)
        heapq.heappush(self._heap, (handle.time, next(self._order), handle))
        return handle

    def after(self, delay: float, callback: Callable[[], None]) -> Handle:
        """Run ``callback`` ``delay`` seconds from now."""
        return self.at(self.clock.time + max(delay, 0.0), callback)

    def stop(self) -> None:
        """End :meth:`run` after the current callback."""
        self.stopped = True

    def run(self, *, until: float, max_events: int) -> None:
        """Run callbacks up to time ``until`` (or :meth:`stop`).

        Raises DynarlError when more than ``max_events`` callbacks would run (a model
        that never settles), so every run is bounded.
        """
        self.stopped = False
        heap = self._heap
        while heap and not self.stopped:
            time, _, handle = heap[0]
            if time > until:
                break
            heapq.heappop(heap)
            if handle.cancelled:
                continue
            self.num_events += 1
            if self.num_events > max_events:
                raise DynarlError(f"simulation exceeded {max_events} events")
            self.clock.time = time
            handle.cancelled = True
            handle.callback()


class Wait:
    """Something a :class:`Task` can ``await``: it resumes once :meth:`fire` is called."""

    __slots__ = ("_waiter", "done", "value")

    def __init__(self) -> None:
        self.done = False
        self.value: object = None
        self._waiter: Callable[[], None] | None = None

    def fire(self, value: object = None) -> None:
        """Resume the task awaiting this (at most once)."""
        if self.done:
            return
        self.done = True
        self.value = value
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            waiter()

    def __await__(self) -> Generator[Wait, None, object]:
        if not self.done:
            yield self
        return self.value

    @classmethod
    def delay(cls, loop: EventLoop, seconds: float) -> Wait:
        """A wait that fires ``seconds`` from now."""
        wait = cls()
        loop.after(seconds, wait.fire)
        return wait


class Task:
    """Runs a coroutine that awaits only :class:`Wait` s (see the module docstring)."""

    def __init__(self, loop: EventLoop, coro: Coroutine[Any, Any, None], name: str) -> None:
        self.loop = loop
        self.name = name
        self.done = False
        self._coro = coro
        loop.at(loop.now, self._step)

    def _step(self) -> None:
        try:
            wait = self._coro.send(None)
        except StopIteration:
            self.done = True
            return
        if not isinstance(wait, Wait):
            self._coro.close()
            raise DynarlError(f"task {self.name} awaited {wait!r}, not a simulator Wait")
        wait._waiter = self._resume

    def _resume(self) -> None:
        self.loop.at(self.loop.now, self._step)

    def cancel(self) -> None:
        """Close the coroutine (it is not resumed again)."""
        if not self.done:
            self.done = True
            self._coro.close()
