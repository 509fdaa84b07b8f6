"""The migration of one component inside a move, on the migrate state machines.

Every driver runs its forward steps up to (not including) ``commit`` in
:meth:`pre_commit`, then either :meth:`commit` or :meth:`cancel` (abort, then roll back
to the previous allocation). Each step first asks the :class:`FaultInjector` (phase
``"<kind>.<step>"``). Drivers:

- :class:`WorkloadMove` (serving components): activate the role on added devices, then
  the migrate :class:`~dynarl.migrate.WorkloadMigration` of the removed ones over the
  component's dispatcher (parked continuations when no device is left);
- :class:`P2PMove`: the migrate P2P steps on every rank (``prepare``, ``transfer``,
  ``verify``, ``commit``), the coordinator's own lease and log in a migrate
  ``MigrationState``;
- :class:`RebootMove`: the migrate :class:`~dynarl.migrate.RebootMigration`, or the same
  steps in place (sleep and wake where the roles are) for a component that shrinks to
  nothing or grows back from nothing.

Runs on the controller's event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dynarl.migrate.protocol import MigrationState, Outcome, Step, new_migration, run_step
from dynarl.migrate.reboot import RebootMigration
from dynarl.migrate.workload import PartialRequest, WorkloadMigration
from dynarl.runtime.dispatch import Dispatcher
from dynarl.runtime.faults import FaultInjector
from dynarl.runtime.manager import GroupManager, RebootRoles
from dynarl.types import MigrationKind

__all__ = ["ComponentMove", "Driver", "P2PMove", "RebootMove", "WorkloadMove", "driver_for"]

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

    async def _fault(self, step: str) -> None:
        await self.faults.at(f"{self.move.kind}.{step}", deadline=self.deadline)

    async def pre_commit(self) -> Outcome | None:
        """Run every forward step before commit; the failed outcome, or None."""
        raise NotImplementedError

    async def commit(self) -> Outcome:
        """Commit (the devices change hands)."""
        raise NotImplementedError

    async def cancel(self, reason: str) -> Outcome:
        """Abort and roll back; the rollback outcome."""
        raise NotImplementedError


class _Machine:
    """Forward steps of one kind on the migrate protocol's state machine (lease, log)."""

    def __init__(self, migration_id: str, kind: MigrationKind, lease_s: float) -> None:
        self.state = new_migration(migration_id, kind, now=time.monotonic(), lease_s=lease_s)

    async def step(self, step: Step, action: Callable[[], Awaitable[str]]) -> Outcome:
        self.state, outcome = await run_step(self.state, step, now=time.monotonic(), action=action)
        return outcome


async def _nothing() -> str:
    return ""


class _FaultyHost:
    """The dispatcher as WorkloadHost, asking the fault injector before every step."""

    def __init__(self, driver: WorkloadMove, dispatcher: Dispatcher) -> None:
        self._driver, self._dispatcher = driver, dispatcher

    async def stop_routing(self, workers: Sequence[int]) -> None:
        self._driver.paused_at = time.monotonic()
        await self._driver._fault("stop_routing")
        await self._dispatcher.stop_routing(workers)

    async def abort_inflight(self, workers: Sequence[int]) -> Sequence[PartialRequest]:
        await self._driver._fault("drain")
        return await self._dispatcher.abort_inflight(workers)

    async def redispatch(self, requests: Sequence[PartialRequest], workers: Sequence[int]) -> None:
        await self._driver._fault("redispatch")
        await self._dispatcher.redispatch(requests, workers)
        if self._driver.paused_at is not None:
            self._driver.pause_s = time.monotonic() - self._driver.paused_at

    async def release(self, workers: Sequence[int]) -> None:
        await self._driver._fault("release")
        await self._dispatcher.release(workers)

    async def resume(self, workers: Sequence[int]) -> None:
        await self._dispatcher.resume(workers)


class WorkloadMove(Driver):
    """A serving component grows (activation) and/or gives devices up (workload migration)."""

    def __init__(self, move: ComponentMove, manager: GroupManager, **kwargs: Any) -> None:
        super().__init__(move, manager, **kwargs)
        dispatcher = self.manager.dispatcher
        assert dispatcher is not None, "workload moves are for serving components"
        self._dispatcher = dispatcher
        self.paused_at: float | None = None
        self._grown = False
        self._drained: list[PartialRequest] = []
        self._parked = False
        host = _FaultyHost(self, dispatcher)
        remaining = tuple(d for d in self.move.dst)
        self._workload: WorkloadMigration | None = None
        self._machine = _Machine(self.migration_id, MigrationKind.WORKLOAD, self.lease_s)
        if self.move.removed and remaining:
            self._workload = WorkloadMigration(
                migration_id=self.migration_id,
                donors=self.move.removed,
                remaining=remaining,
                host=host,
                lease_s=self.lease_s,
                clock=time.monotonic,
            )
        self._host = host

    @property
    def state(self) -> MigrationState:
        return self._workload.state if self._workload is not None else self._machine.state

    async def pre_commit(self) -> Outcome | None:
        if self.move.added:
            await self._fault("grow")
            await self.manager.activate(self.move.added)
            self._grown = True
        if self._workload is not None:
            steps = (
                self._workload.stop_routing,
                self._workload.drain,
                self._workload.redispatch,
                self._workload.release,
            )
            for step in steps:
                outcome = await step()
                if not outcome.ok:
                    return outcome
        elif self.move.removed:
            return await self._park()
        return None

    async def _park(self) -> Outcome | None:
        """Shrink to nothing: drained continuations wait in the dispatcher."""
        donors, drained = self.move.removed, self._drained

        async def drain() -> str:
            drained.extend(await self._host.abort_inflight(donors))
            return ""

        async def stop() -> str:
            await self._host.stop_routing(donors)
            return ""

        async def park() -> str:
            await self._host.redispatch(drained, ())
            self._parked = True
            return ""

        async def release() -> str:
            await self._host.release(donors)
            return ""

        actions = {Step.STOP_ROUTING: stop, Step.DRAIN: drain, Step.REDISPATCH: park}
        actions[Step.RELEASE] = release
        for step, action in actions.items():
            outcome = await self._machine.step(step, action)
            if not outcome.ok:
                return outcome
        return None

    async def commit(self) -> Outcome:
        if self._workload is not None:
            outcome = await self._workload.commit()
        else:
            outcome = await self._machine.step(Step.COMMIT, _nothing)
        if outcome.ok:
            self.manager.set_devices(self.move.dst)
            for device in self.move.added:
                self._dispatcher.add_worker(device)
        return outcome

    async def cancel(self, reason: str) -> Outcome:
        if self._workload is not None:
            outcome = await self._workload.cancel(reason)
        else:
            await self._machine.step(Step.ABORT, _nothing)

            async def resume() -> str:
                await self._host.resume(self.move.removed)
                if not self._parked:  # drained, never handed back: they must not be lost
                    await self._dispatcher.redispatch(self._drained, self.move.removed)
                return ""

            outcome = await self._machine.step(Step.ROLLBACK, resume)
        if self._grown:
            await self.manager.release(self.move.added)
        return outcome


class P2PMove(Driver):
    """A P2P reshard of the component over every rank of its old and new layouts."""

    def __init__(self, move: ComponentMove, manager: GroupManager, **kwargs: Any) -> None:
        super().__init__(move, manager, **kwargs)
        self.epoch = self.epochs()
        self._machine = _Machine(self.migration_id, MigrationKind.P2P, self.lease_s)
        self._began = 0.0

    @property
    def state(self) -> MigrationState:
        return self._machine.state

    def _action(self, step: str) -> Callable[[], Awaitable[str]]:
        async def act() -> str:
            await self._fault(step)
            results = await self.manager.reshard(
                step,
                migration_id=self.migration_id,
                src=self.move.src,
                dst=self.move.dst,
                epoch=self.epoch,
                lease_s=max(self.deadline - time.monotonic(), 0.001),
            )
            self.bytes_moved += sum(r.bytes_moved for r in results)
            return "; ".join(f"rank {r.device}: {r.detail}" for r in results if not r.ok)

        return act

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
        await self._machine.step(Step.ABORT, self._action("abort"))
        outcome = await self._machine.step(Step.ROLLBACK, self._action("rollback"))
        await self._action("close")()
        self.pause_s = time.monotonic() - self._began
        return outcome


class _FaultyReboot:
    """The manager's reboot host, asking the fault injector before every step."""

    def __init__(self, driver: RebootMove, roles: RebootRoles) -> None:
        self._driver, self._roles = driver, roles

    async def save(self) -> str:
        await self._driver._fault("save")
        return await self._roles.save()

    async def stop(self) -> None:
        await self._driver._fault("stop")
        await self._roles.stop()

    async def start(self, resources: Sequence[int]) -> None:
        await self._driver._fault("restart")
        await self._roles.start(resources)

    async def load(self, checkpoint: str) -> None:
        await self._driver._fault("load")
        await self._roles.load(checkpoint)


class RebootMove(Driver):
    """Save, stop, restart on the new devices, load (or sleep/wake in place).

    A component that holds no device yet starts on the new ones from nothing (in place:
    its roles wake where they sleep): the migrate ``RebootMigration`` needs old resources
    to fall back on, so that case runs the same steps on the protocol's state machine
    and rolls back by stopping what it started.
    """

    def __init__(self, move: ComponentMove, manager: GroupManager, **kwargs: Any) -> None:
        super().__init__(move, manager, **kwargs)
        roles = self.manager.reboot_host(
            self.migration_id, epochs=self.epochs, in_place=self.move.in_place
        )
        self._roles = roles
        host = _FaultyReboot(self, roles)
        self._host = host
        self._reboot: RebootMigration | None = None
        self._machine = _Machine(self.migration_id, MigrationKind.REBOOT, self.lease_s)
        if self.move.src:
            self._reboot = RebootMigration(
                migration_id=self.migration_id,
                src_resources=self.move.src,
                host=host,
                lease_s=self.lease_s,
                clock=time.monotonic,
            )
        self._began = 0.0

    @property
    def state(self) -> MigrationState:
        return self._reboot.state if self._reboot is not None else self._machine.state

    async def pre_commit(self) -> Outcome | None:
        self._began = time.monotonic()
        if self._reboot is None:
            return await self._from_nothing()
        reboot = self._reboot
        steps: tuple[Callable[[], Awaitable[Outcome]], ...] = (
            reboot.save,
            reboot.stop,
            lambda: reboot.restart(self.move.dst),
            reboot.load,
        )
        for step in steps:
            outcome = await step()
            if not outcome.ok:
                return outcome
        return None

    async def _from_nothing(self) -> Outcome | None:
        async def restart() -> str:
            await self._host.start(self.move.dst)
            return ""

        actions = {Step.SAVE: _nothing, Step.STOP: _nothing, Step.RESTART: restart}
        actions[Step.LOAD] = _nothing
        for step, action in actions.items():
            outcome = await self._machine.step(step, action)
            if not outcome.ok:
                return outcome
        return None

    async def commit(self) -> Outcome:
        if self._reboot is not None:
            outcome = await self._reboot.commit()
        else:
            outcome = await self._machine.step(Step.COMMIT, _nothing)
        self.pause_s = time.monotonic() - self._began
        if outcome.ok:
            self.manager.set_devices(self.move.dst)
        return outcome

    async def cancel(self, reason: str) -> Outcome:
        if self._reboot is not None:
            outcome = await self._reboot.cancel(reason)
        else:

            async def stop() -> str:
                await self._roles.stop()
                return ""

            await self._machine.step(Step.ABORT, _nothing)
            outcome = await self._machine.step(Step.ROLLBACK, stop)
        self.pause_s = time.monotonic() - self._began
        return outcome


def driver_for(
    move: ComponentMove,
    manager: GroupManager,
    *,
    migration_id: str,
    lease_s: float,
    faults: FaultInjector,
    epochs: Callable[[], int],
) -> Driver:
    """The driver of ``move``'s kind."""
    kinds: dict[MigrationKind, type[Driver]] = {
        MigrationKind.WORKLOAD: WorkloadMove,
        MigrationKind.P2P: P2PMove,
        MigrationKind.REBOOT: RebootMove,
    }
    return kinds[move.kind](
        move, manager, migration_id=migration_id, lease_s=lease_s, faults=faults, epochs=epochs
    )
