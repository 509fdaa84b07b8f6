"""dynarl's own scheduler, driven in virtual time (no second copy of any decision).

The policy builds the real :class:`~dynarl.sched.Scheduler` with the simulator's clock,
the three components as hypernodes, a :class:`~dynarl.sched.RegressionPredictor` seeded
with the offline profiles, and the modelled migration cost. Every interval it hands the
components' reports to :meth:`Scheduler.handle`; each :class:`MigrationCommand` that
comes back is executed in the model (with its modelled pause), and its
:class:`MoveOutcome` — with one :class:`MigrationRecord` per resized component — goes
back to the scheduler when the pause ends. ``dynarl+priority`` is the same scheduler with
the engines' request queues ordered by DynaRL's priority (completed tool calls, then
reusable cached prefix) instead of FIFO. Both start from the static split.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynarl.bus import ComponentReport, MigrationRecord
from dynarl.sched import (
    FifoPolicy,
    MigrationCommand,
    MoveOutcome,
    PriorityPolicy,
    RegressionPredictor,
    RequestPolicy,
    Scheduler,
)
from dynarl.sim.components import COMPONENTS
from dynarl.sim.profile import best_partition, predictor_profiles
from dynarl.sim.simulator import Simulation
from dynarl.types import Allocation

__all__ = ["DynarlPolicy"]


class DynarlPolicy:
    """The real scheduler in the loop (see the module docstring)."""

    asynchronous = False

    def __init__(self, *, priority: bool = False, partition: Mapping[str, int] | None = None):
        self.priority = priority
        self.name = "dynarl+priority" if priority else "dynarl"
        self.partition = dict(partition) if partition is not None else None
        self.scheduler: Scheduler | None = None
        self._number = 0

    def request_policy(self) -> RequestPolicy:
        """The engines' queue order."""
        return PriorityPolicy() if self.priority else FifoPolicy()

    def setup(self, sim: Simulation) -> None:
        """Place the static split and build the scheduler on the simulator's clock."""
        w = sim.workload
        sim.assign(self.partition if self.partition is not None else best_partition(w))
        self.scheduler = Scheduler(
            graph=sim.nodes,
            allocation=sim.allocation,
            predictor=RegressionPredictor(predictor_profiles(w)),
            cost=sim.cost,
            clock=sim.clock,
            config=w.scheduler,
            free=sorted(sim.free),
        )

    def on_reports(self, sim: Simulation, reports: Mapping[str, ComponentReport]) -> None:
        """Feed every component's report to the scheduler; run what it commits."""
        assert self.scheduler is not None
        for name in COMPONENTS:
            for command in self.scheduler.handle(reports[name]):
                self._execute(sim, command)

    def on_event(self, sim: Simulation, event: str, iteration: int, index: int = 0) -> None:
        """The scheduler acts on reports only."""

    def _execute(self, sim: Simulation, command: MigrationCommand) -> None:
        before = sim.allocation
        start = sim.loop.now
        pause = sim.execute(
            command.moves, on_done=lambda: self._finished(sim, command, before, start)
        )
        del pause

    def _finished(
        self, sim: Simulation, command: MigrationCommand, before: Allocation, start: float
    ) -> None:
        assert self.scheduler is not None
        after = sim.allocation
        records = []
        for name in COMPONENTS:
            if before.devices(name) == after.devices(name):
                continue
            self._number += 1
            records.append(
                MigrationRecord(
                    migration_id=f"{command.decision_id}-m{self._number}",
                    decision_id=command.decision_id,
                    time=sim.loop.now,
                    kind=sim.nodes[name].migration.value,
                    component=name,
                    src_devices=before.devices(name),
                    dst_devices=after.devices(name),
                    outcome="committed",
                    pause_s=sim.loop.now - start,
                )
            )
        outcome = MoveOutcome(
            decision_id=command.decision_id, ok=True, allocation=after, records=tuple(records)
        )
        for follow in self.scheduler.handle(outcome):
            self._execute(sim, follow)
