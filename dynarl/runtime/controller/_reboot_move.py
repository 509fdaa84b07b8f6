"""RebootMove: save, stop, restart on the new devices, load — or sleep and wake in place.

The migrate :class:`~dynarl.migrate.RebootMigration` over the component's
:class:`~dynarl.runtime.controller._group_manager.RebootRoles`; in place (a stateful component that
shrinks to nothing, or grows back where it sleeps) nothing is written and the roles
sleep or wake where they are. Each step asks the fault injector first (``reboot.save``,
``reboot.stop``, ``reboot.restart``, ``reboot.load``, ``reboot.commit``).
Runs on the controller's loop.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from dynarl.migrate import MigrationState, Outcome, RebootMigration, Step
from dynarl.runtime.controller._group_manager import GroupManager, RebootRoles
from dynarl.runtime.controller._moves import ComponentMove, Driver, StepMachine, nothing
from dynarl.types import MigrationKind

__all__ = ["RebootMove"]


class _FaultyReboot:
    """The manager's reboot host, asking the fault injector before every step."""

    def __init__(self, driver: RebootMove, roles: RebootRoles) -> None:
        self._driver, self._roles = driver, roles

    async def save(self) -> str:
        await self._driver.fault("save")
        return await self._roles.save()

    async def stop(self) -> None:
        await self._driver.fault("stop")
        await self._roles.stop()

    async def start(self, resources: Sequence[int]) -> None:
        await self._driver.fault("restart")
        await self._roles.start(resources)

    async def load(self, checkpoint: str) -> None:
        await self._driver.fault("load")
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
        self._machine = StepMachine(self.migration_id, MigrationKind.REBOOT, self.lease_s)
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
            return await self._fromnothing()
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

    async def _fromnothing(self) -> Outcome | None:
        async def restart() -> str:
            await self._host.start(self.move.dst)
            return ""

        actions = {Step.SAVE: nothing, Step.STOP: nothing, Step.RESTART: restart}
        actions[Step.LOAD] = nothing
        for step, action in actions.items():
            outcome = await self._machine.step(step, action)
            if not outcome.ok:
                return outcome
        return None

    async def commit(self) -> Outcome:
        await self.fault("commit")
        if self._reboot is not None:
            outcome = await self._reboot.commit()
        else:
            outcome = await self._machine.step(Step.COMMIT, nothing)
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

            await self._machine.step(Step.ABORT, nothing)
            outcome = await self._machine.step(Step.ROLLBACK, stop)
        self.pause_s = time.monotonic() - self._began
        return outcome
