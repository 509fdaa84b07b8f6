"""Fault injection at named migration phases: the seam the fault-injection tests use.

A phase is named ``"<kind>.<step>"`` (``"workload.drain"``, ``"p2p.transfer"``,
``"reboot.restart"``, ``"p2p.commit"``; ``"<kind>.grow"`` for a serving component taking
a device). Before the coordinator runs that step it asks the :class:`FaultInjector`,
which applies the first armed :class:`Fault` for the phase:

- ``fail``: the step fails (:class:`InjectedFault`) and the move rolls back;
- ``stall``: the step waits, on the migration's clock, until its lease has lapsed, so it
  is refused (instantly in virtual time);
- ``kill``: the worker of ``device`` is sent SIGKILL, then the step runs;
- ``cut``: the network link of ``device``'s host goes down (through the :attr:`FaultInjector.cut`
  hook a multi-host test sets), then the step runs: the worker lives on, unreachable;
- ``kill_controller``: this process (the controller) is sent SIGKILL (a restart test);
- ``drop`` / ``duplicate`` / ``reorder``: faults of the step's control messages, applied
  by the migrations that send one message per rank and step (P2P): the message to
  ``device`` (default: the first rank) is lost, so its reply never comes and the step
  fails at its deadline; every message is delivered twice; or a late copy of the
  previous step's messages arrives after this step's. :meth:`FaultInjector.at` returns
  the fault it fired, for the driver to apply.

Every fault a test injects goes through this one seam (``RuntimeConfig.faults`` or
:meth:`FaultInjector.arm`), never through sleeps or patches elsewhere. Runs on the
controller's event loop.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dynarl.errors import MigrationError
from dynarl.sched import Clock, MonotonicClock

__all__ = ["Fault", "FaultAction", "FaultInjector", "InjectedFault"]

logger = logging.getLogger(__name__)


class FaultAction(enum.StrEnum):
    """What an injected fault does."""

    FAIL = "fail"
    STALL = "stall"
    KILL = "kill"
    CUT = "cut"
    KILL_CONTROLLER = "kill_controller"
    DROP = "drop"
    DUPLICATE = "duplicate"
    REORDER = "reorder"


class InjectedFault(MigrationError):
    """A step failed because a test asked it to."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One fault to inject."""

    phase: str
    """``"<kind>.<step>"``, e.g. ``"p2p.transfer"``."""
    action: FaultAction = FaultAction.FAIL
    """What happens."""
    device: int | None = None
    """The worker to kill (``kill``), whose host's link is cut (``cut``), or whose message
    is dropped (``drop``; None: the first rank)."""
    times: int = 1
    """How many times it fires."""

    def __post_init__(self) -> None:
        kind, dot, step = self.phase.partition(".")
        if not dot or not kind or not step:
            raise ValueError(f"Fault.phase must be '<kind>.<step>', got {self.phase!r}")
        if self.action in (FaultAction.KILL, FaultAction.CUT) and self.device is None:
            raise ValueError(f"a {self.action} fault needs a device")
        if self.times < 1:
            raise ValueError(f"Fault.times must be >= 1, got {self.times}")


@dataclass(slots=True)
class _Armed:
    fault: Fault
    left: int


class FaultInjector:
    """Armed faults, applied by phase (see the module docstring)."""

    def __init__(
        self,
        faults: Iterable[Fault] = (),
        *,
        kill: Callable[[int], None] | None = None,
        cut: Callable[[int], None] | None = None,
    ) -> None:
        self._armed: list[_Armed] = []
        self._kill = kill
        self.cut = cut
        """Takes down the link of a device's host (``cut`` faults); a multi-host test sets
        it."""
        self.fired: list[Fault] = []
        """Faults applied so far, in order."""
        for fault in faults:
            self.arm(fault)

    def arm(self, fault: Fault) -> None:
        """Add ``fault``; it fires at the next ``fault.times`` steps of its phase."""
        self._armed.append(_Armed(fault=fault, left=fault.times))

    def disarm(self) -> list[Fault]:
        """Drop every armed fault that has fires left; those dropped."""
        left = [entry.fault for entry in self._armed if entry.left > 0]
        self._armed.clear()
        return left

    async def at(self, phase: str, *, deadline: float, clock: Clock | None = None) -> Fault | None:
        """Apply the fault armed for ``phase`` if any and return it (message faults are
        the caller's to apply); ``deadline`` is the lease's, on ``clock`` (default: the
        monotonic clock). Raises InjectedFault for a ``fail`` fault."""
        for entry in self._armed:
            fault = entry.fault
            if fault.phase != phase or entry.left <= 0:
                continue
            entry.left -= 1
            self.fired.append(fault)
            logger.warning("injecting %s at %s", fault.action, phase)
            match fault.action:
                case FaultAction.FAIL:
                    raise InjectedFault(f"injected failure at {phase}")
                case FaultAction.STALL:
                    clock = clock if clock is not None else MonotonicClock()
                    await clock.sleep(deadline - clock.now() + 0.05)
                case FaultAction.KILL:
                    if self._kill is None:
                        raise InjectedFault(f"cannot kill at {phase}: no launcher")
                    assert fault.device is not None
                    self._kill(fault.device)
                case FaultAction.CUT:
                    if self.cut is None:
                        raise InjectedFault(f"cannot cut a link at {phase}: no network hook")
                    assert fault.device is not None
                    self.cut(fault.device)
                case FaultAction.KILL_CONTROLLER:
                    logging.shutdown()  # what was logged so far reaches the log files
                    os.kill(os.getpid(), signal.SIGKILL)
            return fault
        return None
