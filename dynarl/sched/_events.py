"""What flows into and out of the scheduler: events, commands, and the clock protocol.

The scheduler reads time only from a :class:`Clock`, takes :data:`SchedulerEvent` s, and
hands :class:`MigrationCommand` s to a :class:`CommandSink`; these are the seams through
which the runtime (real time, ZeroMQ) and the simulator (virtual time) drive it. The
runtime's coordinator, drivers and leases read and wait on the same :class:`Clock`, so
under a :class:`ManualClock` a lease lapses and a step times out in virtual time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from dynarl.bus import ComponentReport, MigrationRecord
from dynarl.sched._decision import DeviceMove
from dynarl.types import Allocation

__all__ = [
    "Clock",
    "CommandSink",
    "ManualClock",
    "MigrationCommand",
    "MonotonicClock",
    "MoveOutcome",
    "OperatorCommand",
    "QuotaChange",
    "SchedulerEvent",
    "Tick",
    "queued_batches",
]


@runtime_checkable
class Clock(Protocol):
    """Where the scheduler reads the time (seconds, any epoch), and where the runtime
    waits for a lease or a step timeout to lapse."""

    def now(self) -> float:
        """The current time."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` (<= 0: none) have passed on this clock; runs on the
        caller's loop."""
        ...


class MonotonicClock:
    """The process's monotonic clock."""

    def now(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """``asyncio.sleep``: the loop's clock is monotonic too."""
        await asyncio.sleep(max(0.0, seconds))


@dataclass(slots=True)
class ManualClock:
    """A clock set by hand: the simulator's virtual time, or a test's."""

    time: float = 0.0

    def now(self) -> float:
        """The time last set."""
        return self.time

    async def sleep(self, seconds: float) -> None:
        """Virtual time: jump forward by ``seconds`` at once, then let the loop's other
        tasks run before returning. Each sleeper moves the clock itself, so waits that
        overlap add up: meant for one waiter at a time (a test's lease or timeout)."""
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0); returns the new time."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self.time += seconds
        return self.time


@dataclass(frozen=True, kw_only=True, slots=True)
class MigrationCommand:
    """Carry out a committed decision: move ``moves`` to reach ``new_allocation``."""

    decision_id: str
    time: float
    old_allocation: Allocation
    new_allocation: Allocation
    moves: tuple[DeviceMove, ...]
    forced: bool = False
    """A reclaim ordered by the cluster, not a choice of the scheduler."""


@runtime_checkable
class CommandSink(Protocol):
    """Where migration commands go (the runtime's coordinator, or the simulator)."""

    async def submit(self, command: MigrationCommand) -> None:
        """Accept ``command``; its outcome comes back later as a :class:`MoveOutcome`."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class MoveOutcome:
    """How a command ended, and the allocation in force afterwards."""

    decision_id: str
    ok: bool
    allocation: Allocation
    reason: str = ""
    records: tuple[MigrationRecord, ...] = ()
    external: bool = False
    """A move the pipeline made on its own, not a command of this scheduler (for instance
    the return to the iteration-start allocation at a synchronous barrier): its
    allocation is taken as in force and its records are kept; a move in flight is not
    ended by it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QuotaChange:
    """The cluster grants devices to the job or takes some back."""

    granted: tuple[int, ...] = ()
    reclaimed: tuple[int, ...] = ()
    lost: bool = False
    """The reclaimed devices are gone already (their workers died): a component they
    leave below its minimum, or with no device, is given devices from the free ones or
    from a component that can spare them, rather than the change being refused."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OperatorCommand:
    """An operator's instruction."""

    action: Literal["enter_safe_mode", "leave_safe_mode", "observe_only", "act"]
    reason: str = "operator"


@dataclass(frozen=True, slots=True)
class Tick:
    """Nothing happened, but time passed: lets rounds and cool-downs run without reports."""


SchedulerEvent = ComponentReport | MoveOutcome | QuotaChange | OperatorCommand | Tick


async def queued_batches(
    queue: asyncio.Queue[SchedulerEvent | None],
) -> AsyncIterator[list[SchedulerEvent]]:
    """Yield every event already queued as one batch, waiting only for the first of each.

    Ends at a ``None`` in the queue (the events before it are yielded first), so the
    scheduler runs one round on all the reports that piled up while it was busy. Runs on
    the loop that owns ``queue``.
    """
    while (first := await queue.get()) is not None:
        batch = [first]
        while not queue.empty():
            event = queue.get_nowait()
            if event is None:
                yield batch
                return
            batch.append(event)
        yield batch
