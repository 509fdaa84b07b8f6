"""Modelled migration costs: what the scheduler is charged and what the model pauses.

One :class:`ModelledMigrationCost` serves both sides: the simulator injects it into the
real :class:`~dynarl.sched.Scheduler` as its :class:`~dynarl.sched.MigrationCost`, and
executes every committed move with a pause of exactly the estimate, so predicted and
realised migration time agree by construction (the realised *benefit* is what the
simulation measures). Seconds per migration kind come from the workload's
``[migration]`` table (calibrated to the paper's Fig. 14: trainer P2P ≈ 0.5 s at 1.5B to
≈ 2.8 s at 32B, rollout workload migration 3.5–5 s); concurrent resizes overlap, so a
move costs its slowest part. Bytes: P2P resizes copy one replica's state per replica
added. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynarl.sched import CostEstimate, Resize
from dynarl.sim.workload import MigrationSpec
from dynarl.types import MigrationKind

__all__ = ["ModelledMigrationCost"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelledMigrationCost:
    """A :class:`~dynarl.sched.MigrationCost` from a workload's migration table."""

    spec: MigrationSpec
    """Seconds per migration kind."""

    def seconds(self, kind: MigrationKind) -> float:
        """Pause of one migration of ``kind``."""
        if kind is MigrationKind.P2P:
            return self.spec.p2p_s
        if kind is MigrationKind.REBOOT:
            return self.spec.reboot_s
        return self.spec.workload_s

    def estimate(self, resizes: tuple[Resize, ...]) -> CostEstimate:
        """The slowest moving resize's seconds; P2P bytes of the replicas added."""
        moving = [r for r in resizes if r.new_devices != r.old_devices]
        seconds = max((self.seconds(r.migration) for r in moving), default=0.0)
        added = sum(
            r.state_bytes * max(0, r.new_devices - r.old_devices) // (r.tp * r.pp)
            for r in moving
            if r.migration is MigrationKind.P2P
        )
        return CostEstimate(seconds=seconds, bytes=added)
