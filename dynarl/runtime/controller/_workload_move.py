"""WorkloadMove: a serving component grows and/or gives devices up.

The migrate :class:`~dynarl.migrate.WorkloadMigration` over the component's dispatcher and
group manager (:class:`_Serving`, its ``WorkloadHost``): added devices get the role
activated and join the router at commit; removed ones stop being routed to, their
in-flight work is aborted with its partial outputs and re-dispatched to the remaining
devices with priority and affinity kept, then released. A component left with no device
keeps its continuations parked in the dispatcher until a device comes back; all of that
is the machine's sequence, this module only maps each step onto the dispatcher. Each step
asks the fault injector first (``workload.grow``, ``workload.stop_routing``, …,
``workload.commit``). Runs on the controller's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynarl.migrate import Migration, PartialRequest, WorkloadMigration
from dynarl.runtime.controller._dispatch import Dispatcher
from dynarl.runtime.controller._group_manager import GroupManager
from dynarl.runtime.controller._moves import Driver

__all__ = ["WorkloadMove"]


class _Serving:
    """The dispatcher and the group manager as the machine's ``WorkloadHost``."""

    def __init__(self, manager: GroupManager, dispatcher: Dispatcher) -> None:
        self._manager, self._dispatcher = manager, dispatcher

    async def stop_routing(self, workers: Sequence[int]) -> None:
        await self._dispatcher.stop_routing(workers)

    async def abort_inflight(self, workers: Sequence[int]) -> Sequence[PartialRequest]:
        return await self._dispatcher.abort_inflight(workers)

    async def redispatch(self, requests: Sequence[PartialRequest], workers: Sequence[int]) -> None:
        await self._dispatcher.redispatch(requests, workers)

    async def release(self, workers: Sequence[int]) -> None:
        await self._dispatcher.release(workers)

    async def resume(self, workers: Sequence[int]) -> None:
        await self._dispatcher.resume(workers)

    async def activate(self, workers: Sequence[int]) -> None:
        await self._manager.activate(workers)

    async def admit(self, workers: Sequence[int]) -> None:
        for device in workers:
            self._dispatcher.add_worker(device)


class WorkloadMove(Driver):
    """A serving component grows (activation) and/or gives devices up (workload migration)."""

    def _machine(self) -> Migration:
        dispatcher = self.manager.dispatcher
        assert dispatcher is not None, "workload moves are for serving components"
        return WorkloadMigration(
            migration_id=self.migration_id,
            donors=self.move.removed,
            remaining=self.move.dst,
            added=self.move.added,
            host=_Serving(self.manager, dispatcher),
            lease_s=self.lease_s,
            clock=self.clock.now,
            on_step=self.fault,
        )
