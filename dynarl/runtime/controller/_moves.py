"""The migration of one component inside a move: the common part, and the P2P driver.

Every driver runs its forward steps up to (not including) ``commit`` in
:meth:`Driver.pre_commit`, then either :meth:`Driver.commit` or :meth:`Driver.cancel`
(abort, then roll back to the previous allocation). Each step first asks the
:class:`~dynarl.runtime._faults.FaultInjector` (phase ``"<kind>.<step>"``). The drivers:

- :class:`~dynarl.runtime.controller._workload_move.WorkloadMove` (serving components);
- :class:`P2PMove`: the migrate P2P steps on every rank (``prepare``, ``transfer``,
  ``verify``, ``commit``), with the coordinator's own lease and log in a migrate
  ``MigrationState`` (:class:`StepMachine`); the injected message faults (``drop``,
  ``duplicate``, ``reorder``) apply to its per-rank step messages;
- :class:`~dynarl.runtime.controller._reboot_move.RebootMove`.

Runs on the controller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dynarl.migrate import MigrationState, Outcome, Step, new_migration, run_step
from dynarl.runtime._faults import Fault, FaultAction, FaultInjector
from dynarl.runtime._worker_protocol import StepResult
from dynarl.runtime.controller._group_manager import GroupManager
from dynarl.types import MigrationKind

__all__ = ["ComponentMove", "Driver", "P2PMove", "StepMachine", "nothing"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ComponentMove:
    """One component's change of devices within a move."""

    component: str
    """The component."""
    kind: MigrationKind
    """How its state moves."""
    src: tuple[int, ...]
    """Devices before."""
    dst: tuple[int, ...]
    """Devices after."""
    in_place: bool = False
    """Reboot in place: roles sleep or wake where they are (nothing is checkpointed)."""

    @property
    def removed(self) -> tuple[int, ...]:
        """Devices it gives up."""
        return tuple(d for d in self.src if d not in self.dst)

    @property
    def added(self) -> tuple[int, ...]:
        """Devices it takes."""
        return tuple(d for d in self.dst if d not in self.src)


class Driver:
    """Base of the per-component migration drivers (see the module docstring)."""

    def __init__(
        self,
        move: ComponentMove,
        manager: GroupManager,
        *,
        migration_id: str,
        lease_s: float,
        faults: FaultInjector,
        epochs: Callable[[], int],
    ) -> None:
        self.move, self.manager, self.migration_id = move, manager, migration_id
        self.faults, self.epochs = faults, epochs
        self.lease_s = lease_s
        self.deadline = time.monotonic() + lease_s
        self.pause_s = 0.0
        self.bytes_moved = 0

    @property
    def state(self) -> MigrationState:
        """The migration's state machine."""
        raise NotImplementedError

    async def fault(self, step: str) -> Fault | None:
        """Apply the fault armed for this kind's ``step``, if any; the fault fired."""
        return await self.faults.at(f"{self.move.kind}.{step}", deadline=self.deadline)

    async def pre_commit(self) -> Outcome | None:
        """Run every forward step before commit; the failed outcome, or None."""
        raise NotImplementedError

    async def commit(self) -> Outcome:
        """Commit (the devices change hands)."""
        raise NotImplementedError

    async def cancel(self, reason: str) -> Outcome:
        """Abort and roll back; the rollback outcome."""
        raise NotImplementedError


class StepMachine:
    """Steps of one kind on the migrate protocol's state machine (lease, log, replay)."""

    def __init__(self, migration_id: str, kind: MigrationKind, lease_s: float) -> None:
        self.state = new_migration(migration_id, kind, now=time.monotonic(), lease_s=lease_s)

    async def step(self, step: Step, action: Callable[[], Awaitable[str]]) -> Outcome:
        """Run ``action`` for ``step`` if the machine allows it; the recorded outcome."""
        self.state, outcome = await run_step(self.state, step, now=time.monotonic(), action=action)
        return outcome


async def nothing() -> str:
    """A step with no side effect."""
    return ""


class P2PMove(Driver):
    """A P2P reshard of the component over every rank of its old and new layouts."""

    def __init__(self, move: ComponentMove, manager: GroupManager, **kwargs: Any) -> None:
        super().__init__(move, manager, **kwargs)
        self.epoch = self.epochs()
        self._machine = StepMachine(self.migration_id, MigrationKind.P2P, self.lease_s)
        self._began = 0.0
        self._previous = ""

    @property
    def state(self) -> MigrationState:
        return self._machine.state

    def _action(
        self, step: str, needed: Sequence[int] | None = None
    ) -> Callable[[], Awaitable[str]]:
        """The step on every rank; it fails if a rank of ``needed`` (default: every
        rank) fails."""

        async def act() -> str:
            fired = await self.fault(step)
            results = await self._send(step, fired)
            self.bytes_moved += sum(r.bytes_moved for r in results)
            self._previous = step
            failed = [r for r in results if not r.ok]
            moot = [r for r in failed if needed is not None and r.device not in needed]
            if moot:
                details = "; ".join(f"rank {r.device}: {r.detail}" for r in moot)
                why = "on ranks holding nothing of the old layout (their watchdogs roll back)"
                logger.warning("%s: %s failed %s: %s", self.migration_id, step, why, details)
            return "; ".join(f"rank {r.device}: {r.detail}" for r in failed if r not in moot)

        return act

    async def _ask(self, step: str, only: Sequence[int] | None = None) -> list[StepResult]:
        return await self.manager.reshard(
            step,
            migration_id=self.migration_id,
            src=self.move.src,
            dst=self.move.dst,
            epoch=self.epoch,
            lease_s=max(self.deadline - time.monotonic(), 0.001),
            only=only,
        )

    async def _send(self, step: str, fired: Fault | None) -> list[StepResult]:
        """This step's message to every rank, with an injected message fault applied."""
        action = fired.action if fired is not None else None
        if action is FaultAction.DROP:
            assert fired is not None
            ranks = sorted(set(self.move.src) | set(self.move.dst))
            lost = fired.device if fired.device is not None else ranks[0]
            delivered = self._ask(step, [r for r in ranks if r != lost])
            # The lost message's reply never comes: the step waits out its deadline.
            wait = min(max(self.deadline - time.monotonic(), 0.0), self.manager.request_timeout_s)
            results, _ = await asyncio.gather(delivered, asyncio.sleep(wait))
            timeout = StepResult(device=lost, ok=False, detail=f"no reply to {step} (dropped)")
            return sorted([*results, timeout], key=lambda r: r.device)
        results = await self._ask(step)
        if action is FaultAction.DUPLICATE:
            results = await self._ask(step)  # the second copy: answered from the log
        elif action is FaultAction.REORDER and self._previous:
            late = await self._ask(self._previous)  # a stale copy after the current step
            logger.info("%s: late %s answered %s", self.migration_id, self._previous, late)
        return results

    async def pre_commit(self) -> Outcome | None:
        self._began = time.monotonic()
        for step in (Step.PREPARE, Step.TRANSFER, Step.VERIFY):
            outcome = await self._machine.step(step, self._action(str(step)))
            if not outcome.ok:
                return outcome
        return None

    async def commit(self) -> Outcome:
        outcome = await self._machine.step(Step.COMMIT, self._action("commit"))
        self.pause_s = time.monotonic() - self._began
        if outcome.ok:
            self.manager.set_devices(self.move.dst)
            await self._action("close")()
        return outcome

    async def cancel(self, reason: str) -> Outcome:
        # The rollback restores the old layout: only its ranks must succeed (a joining
        # rank that is gone or unresponsive holds none of it).
        src = self.move.src
        await self._machine.step(Step.ABORT, self._action("abort", src))
        outcome = await self._machine.step(Step.ROLLBACK, self._action("rollback", src))
        await self._action("close")()
        self.pause_s = time.monotonic() - self._began
        return outcome
