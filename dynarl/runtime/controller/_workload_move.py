"""WorkloadMove: a serving component grows and/or gives devices up.

Added devices get the role activated (and join the router at commit); removed ones go
through the migrate :class:`~dynarl.migrate.WorkloadMigration` over the component's
dispatcher (stop routing, abort in-flight work and collect its partial outputs,
re-dispatch it to the remaining devices with priority and affinity kept, release). A
component left with no device runs the same steps on the protocol's state machine, its
continuations parked in the dispatcher until a device comes back. Each step asks the
fault injector first (``workload.<step>``, ``workload.grow``, ``workload.commit``).
Runs on the controller's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from dynarl.migrate import MigrationState, Outcome, PartialRequest, Step, WorkloadMigration
from dynarl.runtime.controller._dispatch import Dispatcher
from dynarl.runtime.controller._group_manager import GroupManager
from dynarl.runtime.controller._moves import ComponentMove, Driver, StepMachine, nothing
from dynarl.types import MigrationKind

__all__ = ["WorkloadMove"]


class _FaultyHost:
    """The dispatcher as WorkloadHost, asking the fault injector before every step."""

    def __init__(self, driver: WorkloadMove, dispatcher: Dispatcher) -> None:
        self._driver, self._dispatcher = driver, dispatcher

    async def stop_routing(self, workers: Sequence[int]) -> None:
        self._driver.paused_at = time.monotonic()
        await self._driver.fault("stop_routing")
        await self._dispatcher.stop_routing(workers)

    async def abort_inflight(self, workers: Sequence[int]) -> Sequence[PartialRequest]:
        await self._driver.fault("drain")
        return await self._dispatcher.abort_inflight(workers)

    async def redispatch(self, requests: Sequence[PartialRequest], workers: Sequence[int]) -> None:
        await self._driver.fault("redispatch")
        await self._dispatcher.redispatch(requests, workers)
        if self._driver.paused_at is not None:
            self._driver.pause_s = time.monotonic() - self._driver.paused_at

    async def release(self, workers: Sequence[int]) -> None:
        await self._driver.fault("release")
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
        self._machine = StepMachine(self.migration_id, MigrationKind.WORKLOAD, self.lease_s)
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
            await self.fault("grow")
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
        else:  # a pure grow: nothing to drain, the steps only keep the log complete
            for name in (Step.STOP_ROUTING, Step.DRAIN, Step.REDISPATCH, Step.RELEASE):
                outcome = await self._machine.step(name, nothing)
                if not outcome.ok:
                    return outcome
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
        await self.fault("commit")
        if self._workload is not None:
            outcome = await self._workload.commit()
        else:
            outcome = await self._machine.step(Step.COMMIT, nothing)
        if outcome.ok:
            self.manager.set_devices(self.move.dst)
            for device in self.move.added:
                self._dispatcher.add_worker(device)
        return outcome

    async def cancel(self, reason: str) -> Outcome:
        if self._workload is not None:
            outcome = await self._workload.cancel(reason)
        else:
            await self._machine.step(Step.ABORT, nothing)

            async def resume() -> str:
                await self._host.resume(self.move.removed)
                if not self._parked:  # drained, never handed back: they must not be lost
                    await self._dispatcher.redispatch(self._drained, self.move.removed)
                return ""

            outcome = await self._machine.step(Step.ROLLBACK, resume)
        if self._grown:
            await self.manager.release(self.move.added)
        return outcome
