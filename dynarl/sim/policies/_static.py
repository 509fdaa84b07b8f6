"""The static baselines: colocated stages in sequence, and a fixed disaggregated split.

``static-sequential`` (verl colocated / RLinf collocated): every GPU serves one stage at
a time — all generate, then all run log-prob inference, then all train; a stage starts
only when the previous one has finished its last item, and each switch costs the
workload's ``phase_switch_s`` (offload one role, onload the next). ``static-split``
(RLinf disaggregated): the partition :func:`~dynarl.sim._profile.best_partition` picks
offline; stages pipeline, the partition never changes.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynarl.bus import ComponentReport
from dynarl.sched import DeviceMove
from dynarl.sim._components import SimEvent
from dynarl.sim._profile import best_partition
from dynarl.sim._simulator import Simulation

__all__ = ["StaticSequential", "StaticSplit"]


class StaticSequential:
    """Every GPU serves one stage at a time (see the module docstring)."""

    name = "static-sequential"
    asynchronous = False

    def setup(self, sim: Simulation) -> None:
        """All GPUs start as rollout engines."""
        sim.assign({"rollout": sim.workload.cluster.num_gpus})

    def on_reports(self, sim: Simulation, reports: Mapping[str, ComponentReport]) -> None:
        """Static: nothing to decide."""

    def on_event(self, sim: Simulation, event: SimEvent, iteration: int, index: int = 0) -> None:
        """Switch every GPU to the next stage when the current one is done (past a fused
        inference stage, which needs no GPU)."""
        fused = sim.workload.inference.fused
        step = {
            SimEvent.ROLLOUT_DONE: ("rollout", "trainer" if fused else "inference"),
            SimEvent.INFERENCE_DONE: None if fused else ("inference", "trainer"),
            SimEvent.ITERATION_END: ("trainer", "rollout"),
        }.get(event)
        if step is None:
            return
        src, dst = step
        devices = tuple(sorted(sim.holders[src]))
        if devices:
            move = DeviceMove(src=src, dst=dst, devices=devices)
            sim.execute([move], seconds=sim.workload.migration.phase_switch_s)


class StaticSplit:
    """A fixed partition chosen offline the way RLinf's auto-placement does."""

    name = "static-split"
    asynchronous = False

    def __init__(self, partition: Mapping[str, int] | None = None) -> None:
        self.partition = dict(partition) if partition is not None else None

    def setup(self, sim: Simulation) -> None:
        """Place the partition (found offline unless given)."""
        if self.partition is None:
            self.partition = best_partition(sim.workload)
        sim.assign(self.partition)

    def on_reports(self, sim: Simulation, reports: Mapping[str, ComponentReport]) -> None:
        """Static: nothing to decide."""

    def on_event(self, sim: Simulation, event: SimEvent, iteration: int, index: int = 0) -> None:
        """Static: nothing to decide."""
