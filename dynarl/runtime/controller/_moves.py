"""The migration of one component inside a move: the common part, and the P2P driver.

One driver per migration kind, each a thin shell over the ``dynarl.migrate`` state machine
of its kind: the machine sequences the steps (growing from and shrinking to no device
included), the driver supplies the I/O of each step (a host over the component's group
manager) and calls nothing but :meth:`~dynarl.migrate.Migration.run_to_commit`, then
:meth:`~dynarl.migrate.Migration.commit` or :meth:`~dynarl.migrate.Migration.cancel`
(:meth:`Driver.pre_commit`, :meth:`Driver.commit`, :meth:`Driver.cancel`). Each forward step
first asks the :class:`~dynarl.runtime._faults.FaultInjector` (phase ``"<kind>.<step>"``).

- :class:`~dynarl.runtime.controller._workload_move.WorkloadMove` (serving components);
- :class:`P2PMove`: :class:`~dynarl.migrate.P2PGroupMigration` over every rank of the old and
  new layouts, one message per rank and step; the injected message faults (``drop``,
  ``duplicate``, ``reorder``) apply to those messages, so this driver asks the injector in
  its host rather than at the start of the step;
- :class:`~dynarl.runtime.controller._reboot_move.RebootMove`.

Time: every lease, deadline, step timeout and pause reads the injected
:class:`~dynarl.sched.Clock` (``now``, ``sleep``), so they run in virtual time under a
:class:`~dynarl.sched.ManualClock`. The deadlines that bound real I/O (a request to a worker,
``RuntimeConfig.request_timeout_s``; a dispatcher's drain) stay on the event loop's clock
as ``asyncio.timeout``: they measure how long a real peer takes, which virtual time cannot
shorten. Runs on the controller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynarl.migrate import Migration, MigrationState, Outcome, P2PGroupMigration
from dynarl.runtime._faults import Fault, FaultAction, FaultInjector
from dynarl.runtime._worker_protocol import StepResult
from dynarl.runtime.controller._group_manager import GroupManager
from dynarl.sched import Clock
from dynarl.types import MigrationKind

__all__ = ["ComponentMove", "Driver", "P2PMove"]

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
    """Base of the per-component migration drivers (see the module docstring).

    A subclass builds its kind's machine in :meth:`_machine`, over a host of its own.
    """

    def __init__(
        self,
        move: ComponentMove,
        manager: GroupManager,
        *,
        migration_id: str,
        lease_s: float,
        faults: FaultInjector,
        epochs: Callable[[], int],
        clock: Clock,
    ) -> None:
        self.move, self.manager, self.migration_id = move, manager, migration_id
        self.faults, self.epochs, self.clock = faults, epochs, clock
        self.lease_s = lease_s
        self.bytes_moved = 0
        self.machine = self._machine()

    def _machine(self) -> Migration:
        raise NotImplementedError

    @property
    def state(self) -> MigrationState:
        """The migration's state machine."""
        return self.machine.state

    @property
    def deadline(self) -> float:
        """The lease's deadline, on the clock."""
        return self.state.deadline

    @property
    def pause_s(self) -> float:
        """Seconds the component was paused (0 until the move ended)."""
        return self.machine.pause_s

    async def fault(self, step: object) -> Fault | None:
        """Apply the fault armed for this kind's ``step``, if any; the fault fired."""
        phase = f"{self.move.kind}.{step}"
        return await self.faults.at(phase, deadline=self.deadline, clock=self.clock)

    async def pre_commit(self) -> Outcome | None:
        """Run every forward step before commit; the failed outcome, or None."""
        return await self.machine.run_to_commit()

    async def commit(self) -> Outcome:
        """Commit (the devices change hands)."""
        outcome = await self.machine.commit()
        if outcome.ok:
            self.manager.set_devices(self.move.dst)
        return outcome

    async def cancel(self, reason: str) -> Outcome:
        """Abort and roll back; the rollback outcome."""
        return await self.machine.cancel(reason)


class _Ranks:
    """Every rank of a P2P move, as the machine's ``P2PHost``: one message per rank."""

    def __init__(self, driver: P2PMove) -> None:
        self._driver = driver
        self._previous = ""

    async def step(self, step: object) -> Mapping[int, str]:
        name = str(step)
        fired = await self._driver.fault(name)
        results = await self._send(name, fired)
        self._driver.bytes_moved += sum(r.bytes_moved for r in results)
        self._previous = name
        return {r.device: r.detail for r in results if not r.ok}

    async def close(self) -> None:
        failed = await self.step("close")
        if failed:
            logger.warning("%s: close failed on ranks %s", self._driver.migration_id, failed)

    async def _ask(self, step: str, only: Sequence[int] | None = None) -> list[StepResult]:
        driver = self._driver
        return await driver.manager.reshard(
            step,
            migration_id=driver.migration_id,
            src=driver.move.src,
            dst=driver.move.dst,
            epoch=driver.epoch,
            lease_s=max(driver.deadline - driver.clock.now(), 0.001),
            only=only,
        )

    async def _send(self, step: str, fired: Fault | None) -> list[StepResult]:
        """This step's message to every rank, with an injected message fault applied."""
        action = fired.action if fired is not None else None
        if action is FaultAction.DROP:
            assert fired is not None
            driver = self._driver
            ranks = sorted(set(driver.move.src) | set(driver.move.dst))
            lost = fired.device if fired.device is not None else ranks[0]
            delivered = self._ask(step, [r for r in ranks if r != lost])
            # The lost message's reply never comes: the step waits out its deadline.
            left = max(driver.deadline - driver.clock.now(), 0.0)
            wait = min(left, driver.manager.request_timeout_s)
            results, _ = await asyncio.gather(delivered, driver.clock.sleep(wait))
            timeout = StepResult(device=lost, ok=False, detail=f"no reply to {step} (dropped)")
            return sorted([*results, timeout], key=lambda r: r.device)
        results = await self._ask(step)
        if action is FaultAction.DUPLICATE:
            results = await self._ask(step)  # the second copy: answered from the log
        elif action is FaultAction.REORDER and self._previous:
            late = await self._ask(self._previous)  # a stale copy after the current step
            logger.info("%s: late %s answered %s", self._driver.migration_id, self._previous, late)
        return results


class P2PMove(Driver):
    """A P2P reshard of the component over every rank of its old and new layouts."""

    def __init__(self, move: ComponentMove, manager: GroupManager, **kwargs: Any) -> None:
        self.epoch = 0
        super().__init__(move, manager, **kwargs)

    def _machine(self) -> Migration:
        self.epoch = self.epochs()
        return P2PGroupMigration(
            migration_id=self.migration_id,
            src=self.move.src,
            dst=self.move.dst,
            host=_Ranks(self),
            lease_s=self.lease_s,
            clock=self.clock.now,
        )
