"""What a decision round takes and returns: the frozen RoundInput, candidates, device moves,
the frozen Decision; the cost protocol.

``sched`` never imports ``migrate``: the cost of a move comes through the
:class:`MigrationCost` protocol defined here and injected by the caller (the runtime
builds one on the migrate planner, the simulator on its model).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dynarl.bus import CandidateReason, DecisionReason, DecisionRecord, RejectedCandidate
from dynarl.sched._graph import HyperNode
from dynarl.sched._predictor import ThroughputPredictor
from dynarl.sched._sched_config import SchedulerConfig
from dynarl.sched._window import ComponentStats, DonorSignal
from dynarl.types import Allocation, MigrationKind

__all__ = [
    "Candidate",
    "CostEstimate",
    "Decision",
    "DeviceMove",
    "MigrationCost",
    "Rejection",
    "Resize",
    "RoundInput",
    "StaticMigrationCost",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Resize:
    """One component's change of size in a candidate."""

    component: str
    migration: MigrationKind
    """How its state moves."""
    old_devices: int
    new_devices: int
    tp: int = 1
    pp: int = 1
    state_bytes: int = 0
    """Bytes of one full replica's state."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CostEstimate:
    """Predicted cost of carrying out a set of resizes."""

    seconds: float
    """Time charged against the remaining iteration time."""
    bytes: int = 0
    """Bytes the migration moves between devices."""


@runtime_checkable
class MigrationCost(Protocol):
    """Predicts what a set of resizes costs; called once per evaluated candidate."""

    def estimate(self, resizes: tuple[Resize, ...]) -> CostEstimate:
        """Cost of performing all ``resizes`` (they run concurrently)."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticMigrationCost:
    """A fixed cost per migration kind; moves run concurrently, so the slowest counts.

    Bytes: a P2P resize copies one replica's state per replica added. A simple model
    for tests and first runs; the runtime injects one built on the migrate planner.
    """

    seconds: Mapping[MigrationKind, float]
    """Seconds per kind of migration."""

    def estimate(self, resizes: tuple[Resize, ...]) -> CostEstimate:
        """Slowest kind's seconds, P2P bytes summed."""
        moving = [r for r in resizes if r.new_devices != r.old_devices]
        seconds = max((self.seconds.get(r.migration, 0.0) for r in moving), default=0.0)
        added = sum(
            r.state_bytes * max(0, r.new_devices - r.old_devices) // (r.tp * r.pp)
            for r in moving
            if r.migration is MigrationKind.P2P
        )
        return CostEstimate(seconds=seconds, bytes=added)


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundInput:
    """Everything one decision round reads: the pipeline, its devices and reports, the models.

    :func:`~dynarl.sched._planner.decide` and :func:`~dynarl.sched._planner.hold` take one,
    and so do the Stage 2 functions they call; the scheduler (or a test) builds it once a
    round.
    """

    nodes: Mapping[str, HyperNode]
    """The components, by name."""
    allocation: Allocation
    """Devices per component in force."""
    free: tuple[int, ...] = ()
    """Devices of the job's quota no component holds."""
    stats: Mapping[str, ComponentStats]
    """Each reporting component's window statistics and latest report."""
    donors: tuple[DonorSignal, ...] = ()
    """Components Stage 1 flagged as over-provisioned."""
    predictor: ThroughputPredictor
    """Predicts each component's throughput at a size."""
    cost: MigrationCost
    """Predicts what a set of resizes costs."""
    config: SchedulerConfig
    """The scheduler's settings."""
    time: float
    """Clock time of the round, seconds."""
    held: frozenset[str] = frozenset()
    """Components the loss rule holds: Stage 2 neither shrinks nor grows them."""

    def counts(self) -> dict[str, int]:
        """Devices each component of ``nodes`` holds."""
        return {name: self.allocation.count(name) for name in self.nodes}


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One allocation Stage 2 evaluated, with every predicted number."""

    donor: str | None
    """Component that shrinks (None: only free devices are handed out)."""
    sizes: tuple[tuple[str, int], ...]
    """Devices per component under this candidate, by name."""
    throughput: tuple[tuple[str, float], ...]
    """Predicted items/s per component."""
    pipeline_rate: float
    """min over components of throughput / remaining: iteration fraction per second."""
    remaining_s: float
    """1 / pipeline_rate: predicted time to finish the iteration, seconds."""
    bottleneck: str | None
    """Component attaining the minimum."""
    num_free: int = 0
    """Devices left unassigned."""
    cost_s: float = 0.0
    """Predicted migration cost, seconds."""
    cost_bytes: int = 0
    """Predicted migration bytes."""
    gain_s: float = 0.0
    """Current remaining time minus (this remaining time + cost); > 0 is an improvement."""

    def size(self, component: str) -> int:
        """Devices ``component`` holds under this candidate."""
        return dict(self.sizes).get(component, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Rejection:
    """A candidate not committed, and why."""

    candidate: Candidate
    reason: CandidateReason


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceMove:
    """Devices moving from one holder to another (None: the job's free pool)."""

    src: str | None
    dst: str | None
    devices: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """The outcome of one decision round, committed or not."""

    time: float
    """Clock time of the round, seconds."""
    committed: bool
    """Whether ``chosen`` is to be carried out."""
    reason: DecisionReason
    """Why it committed or did not."""
    old_allocation: Allocation
    """Devices per component before the round."""
    current: Candidate
    """The current allocation's predicted numbers."""
    chosen: Candidate | None = None
    """The best candidate (committed or not)."""
    moves: tuple[DeviceMove, ...] = ()
    """Concrete device moves of ``chosen`` (empty unless committed)."""
    donors: tuple[str, ...] = ()
    """Components Stage 1 flagged."""
    rejected: tuple[Rejection, ...] = ()
    """Candidates not committed, with reasons."""
    num_levels: int = 0
    """Distinct throughput levels the search could aim at."""
    exhaustive: bool = False
    """Whether every level was evaluated (always true on small instances)."""

    @property
    def receivers(self) -> tuple[str, ...]:
        """Components that grow under ``chosen``."""
        if self.chosen is None:
            return ()
        return tuple(name for name, n in self.chosen.sizes if n > self.current.size(name))

    def new_allocation(self) -> Allocation:
        """The allocation after ``moves`` (the old one when nothing moves)."""
        mapping = {name: set(devs) for name, devs in self.old_allocation.assignment}
        for move in self.moves:
            if move.src is not None:
                mapping[move.src] -= set(move.devices)
            if move.dst is not None:
                mapping.setdefault(move.dst, set()).update(move.devices)
        return Allocation.of(mapping)

    def to_record(self, decision_id: str) -> DecisionRecord:
        """The ledger record of this round."""
        old = dict(self.current.sizes)
        chosen = self.chosen if self.committed else None
        return DecisionRecord(
            decision_id=decision_id,
            time=self.time,
            committed=self.committed,
            reason=self.reason,
            old_allocation=old,
            new_allocation=dict(chosen.sizes) if chosen else old,
            donor=(chosen.donor if chosen else (self.donors[0] if self.donors else None)),
            receivers=self.receivers if chosen else (),
            predicted_bottleneck=(chosen or self.current).bottleneck,
            predicted_throughput_old=self.current.pipeline_rate,
            predicted_throughput_new=(chosen or self.current).pipeline_rate,
            expected_gain_s=chosen.gain_s if chosen else 0.0,
            migration_cost_s=chosen.cost_s if chosen else 0.0,
            migration_bytes=chosen.cost_bytes if chosen else 0,
            rejected=tuple(
                RejectedCandidate(
                    allocation=dict(r.candidate.sizes),
                    predicted_throughput=r.candidate.pipeline_rate,
                    reason=r.reason,
                )
                for r in self.rejected
            ),
        )
