"""The simulated components as the scheduler and the policies see them, and their costs.

- :func:`build_nodes`: rollout, inference and the trainer as the scheduler's hypernodes.
- :class:`ModelledMigrationCost`: one model of migration pauses serves both sides — the
  simulator injects it into the real :class:`~dynarl.sched.Scheduler` as its
  :class:`~dynarl.sched._decision.MigrationCost` and pauses the model by exactly its estimate, so
  predicted and realised migration time agree by construction (the realised *benefit* is
  what the simulation measures). Seconds per kind come from the workload's
  ``[migration]`` table; concurrent resizes overlap, so a move costs its slowest part;
  P2P resizes copy one replica's state per replica added. A P2P component parked at 0
  devices (its state in host memory) unparks, or parks, over the host links instead. A
  trainer limited to reboots (``[migration] trainer_kind = "reboot"``) pays ``reboot_s``
  for every resize to a non-zero size, unparking included, and parks over the host links.
- :func:`migration_bytes`: the bytes a resize moves across devices, per migration kind
  (what the ledger's ``MigrationRecord.bytes_moved`` says for a simulated move).
- The protocols the simulator and the policies share: :class:`RolloutModel` (the
  per-request and the vectorised rollout), :class:`EngineView`, :class:`SimPolicy`, and
  the pipeline events a policy hears (:class:`SimEvent`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dynarl.bus import ComponentReport
from dynarl.sched import CostEstimate, HyperNode, Resize
from dynarl.sim._specs import MigrationSpec
from dynarl.sim._trace import IterationTrace
from dynarl.sim._workload_file import Workload
from dynarl.types import ComponentKind, MigrationKind

if TYPE_CHECKING:
    from dynarl.sim._simulator import Simulation

__all__ = [
    "COMPONENTS",
    "EngineView",
    "ModelledMigrationCost",
    "RolloutModel",
    "SimEvent",
    "SimPolicy",
    "build_nodes",
    "migration_bytes",
]

COMPONENTS = ("rollout", "inference", "trainer")
"""The simulated components."""


class SimEvent(enum.StrEnum):
    """A point of a synchronous iteration that :meth:`SimPolicy.on_event` hears."""

    ITERATION_START = "iteration_start"
    """The iteration's batch was dispatched to rollout."""
    ROLLOUT_DONE = "rollout_done"
    """Every sample of the iteration was generated."""
    INFERENCE_DONE = "inference_done"
    """Every sample went through inference."""
    MINIBATCH = "minibatch"
    """The trainer finished a mini-batch (not the last; ``index`` says which)."""
    ITERATION_END = "iteration_end"
    """The trainer finished the iteration."""


class EngineView(Protocol):
    """What policies may read of one rollout engine."""

    @property
    def index(self) -> int:
        """Engine index (engines started earlier have lower ones)."""
        ...

    @property
    def devices(self) -> tuple[int, ...]:
        """Its devices."""
        ...

    @property
    def load(self) -> int:
        """Requests running or waiting on it."""
        ...


class RolloutModel(Protocol):
    """The rollout component as the simulator drives it (per-request or vectorised)."""

    @property
    def engines(self) -> Mapping[int, EngineView]:
        """Live engines by index."""
        ...

    @property
    def pending(self) -> Sequence[object]:
        """Requests waiting for any engine."""
        ...

    @property
    def unfinished(self) -> int:
        """Samples started and not finished."""
        ...

    def add_devices(self, devices: Iterable[int], *, routable: bool = True) -> Sequence[object]:
        """Start engines on ``devices``."""
        ...

    def remove_devices(self, devices: Iterable[int]) -> list[tuple[int, ...]]:
        """Abort the engines on ``devices``; returns leftover device groups."""
        ...

    def start(self, trace: IterationTrace, samples: Sequence[int] | None = None) -> None:
        """Dispatch samples."""
        ...

    def report(self, *, remaining: int, iteration: int) -> ComponentReport:
        """The interval's report."""
        ...

    def new_iteration(self) -> None:
        """Zero the completed-in-iteration count."""
        ...

    def busy_devices(self) -> int:
        """Devices running something."""
        ...

    def totals(self) -> tuple[int, int]:
        """(prefill tokens, of which re-prefill)."""
        ...


class SimPolicy(Protocol):
    """Decides the allocation in a :class:`Simulation`; every hook may call ``execute``."""

    name: str
    """Policy name."""
    asynchronous: bool
    """Whether the policy runs its own sample flow (no iteration barrier)."""

    def setup(self, sim: Simulation) -> None:
        """Place the initial allocation (and, when asynchronous, start the flow)."""
        ...

    def on_reports(self, sim: Simulation, reports: Mapping[str, ComponentReport]) -> None:
        """Every reporting interval."""
        ...

    def on_event(self, sim: Simulation, event: SimEvent, iteration: int, index: int = 0) -> None:
        """At each :class:`SimEvent` of iteration ``iteration`` (``index``: the mini-batch)."""
        ...


def build_nodes(workload: Workload, trainer_dp_sizes: tuple[int, ...] = ()) -> dict[str, HyperNode]:
    """The scheduler's view of the three components.

    Rollout may park (hold no device) once its iteration's samples are done: Stage 2 keeps
    a replica of any component with items left. The trainer parks when the workload's does,
    and migrates as ``[migration] trainer_kind`` says (P2P reshard or reboot)."""
    w = workload
    return {
        "rollout": HyperNode(
            name="rollout",
            kind=ComponentKind.ROLLOUT,
            migration=MigrationKind.WORKLOAD,
            tp=w.rollout.tp,
            min_devices=w.rollout.tp,
            # Its engines idle from the iteration's last sample to the barrier, which
            # reloads them with the new weights anyway: once done, rollout may hold no
            # device, so its last engine never strands the GPUs beside it.
            parkable=True,
            successors=("inference",),
        ),
        "inference": HyperNode(
            name="inference",
            kind=ComponentKind.INFERENCE,
            migration=MigrationKind.WORKLOAD,
            tp=w.inference.tp,
            min_devices=w.inference.min_gpus,
            predecessors=("rollout",),
            successors=("trainer",),
        ),
        "trainer": HyperNode(
            name="trainer",
            kind=ComponentKind.TRAINER,
            migration=MigrationKind(w.migration.trainer_kind),
            tp=w.trainer.tp,
            min_devices=w.trainer.min_gpus,
            parkable=w.trainer.parkable,
            dp_sizes=trainer_dp_sizes,
            state_bytes=w.model.state_bytes,
            sharded_state_fraction=w.model.sharded_state_fraction,
            predecessors=("inference",),
        ),
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelledMigrationCost:
    """A :class:`~dynarl.sched._decision.MigrationCost` from a workload's migration table."""

    spec: MigrationSpec
    """Seconds per migration kind."""
    sharded_state_fraction: float = 0.0
    """Part of a P2P component's state sharded over its data-parallel ranks."""

    def seconds(self, kind: MigrationKind) -> float:
        """Pause of one migration of ``kind``."""
        if kind is MigrationKind.P2P:
            return self.spec.p2p_s
        if kind is MigrationKind.REBOOT:
            return self.spec.reboot_s
        return self.spec.workload_s

    def park_seconds(self, resize: Resize) -> float:
        """Pause of parking (to 0 devices) or unparking (from 0) a P2P component.

        Its state crosses the host links: each GPU of the non-zero side sends or receives
        what it holds (the replicated part of its TP shard plus its DP share of the
        sharded part) over its own link, all in parallel.
        """
        n = max(resize.old_devices, resize.new_devices)
        unit = resize.tp * resize.pp
        dp = max(n // unit, 1)
        f = self.sharded_state_fraction
        per_gpu = resize.state_bytes / unit * ((1.0 - f) + f / dp)
        return per_gpu / (self.spec.host_gbps * 1e9)

    def resize_seconds(self, resize: Resize) -> float:
        """Pause of one resize: a park or unpark over the host links, else its kind's.

        A REBOOT component's park is a save, over the host links like a P2P park; its
        unpark restarts it under the new devices, a reboot."""
        kind, old, new = resize.migration, resize.old_devices, resize.new_devices
        if kind is MigrationKind.P2P:
            parking = 0 in (old, new)
        else:
            parking = kind is MigrationKind.REBOOT and new == 0 < old
        return self.park_seconds(resize) if parking else self.seconds(kind)

    def estimate(self, resizes: tuple[Resize, ...]) -> CostEstimate:
        """The slowest moving resize's seconds; P2P bytes of the replicas added."""
        moving = [r for r in resizes if r.new_devices != r.old_devices]
        seconds = max((self.resize_seconds(r) for r in moving), default=0.0)
        added = sum(
            r.state_bytes * max(0, r.new_devices - r.old_devices) // (r.tp * r.pp)
            for r in moving
            if r.migration is MigrationKind.P2P
        )
        return CostEstimate(seconds=seconds, bytes=added)

    def move_seconds(
        self, nodes: Mapping[str, HyperNode], old: Mapping[str, int], new: Mapping[str, int]
    ) -> float:
        """Pause of a move from device counts ``old`` to ``new`` (what the scheduler is charged)."""
        resizes = tuple(
            Resize(
                component=name,
                migration=nodes[name].migration,
                old_devices=old[name],
                new_devices=new[name],
                tp=nodes[name].tp,
                state_bytes=nodes[name].state_bytes,
            )
            for name in COMPONENTS
            if new[name] != old[name]
        )
        return self.estimate(resizes).seconds


def migration_bytes(workload: Workload, component: str, old: int, new: int) -> int:
    """Bytes that cross devices when ``component`` goes from ``old`` to ``new`` devices.

    Workload migration (rollout, log-prob inference): each added device loads its shard
    of the bf16 weights (2 bytes a parameter over the replica's TP); released devices
    send nothing (their requests are re-submitted with their tokens, the KV is dropped
    and re-prefilled). P2P (the trainer): each added device receives the replicated part
    of its TP shard of the state, and the part the distributed optimizer shards over DP
    is re-partitioned for the new DP size, of which the share ``1 - min/max`` (old and
    new DP sizes) changes owner. A trainer parking at 0 devices, or unparking from 0, moves
    every byte its GPUs hold to or from host memory. A trainer limited to reboots
    (``[migration] trainer_kind = "reboot"``) saves every byte its old GPUs hold and loads
    every byte its new ones hold. Raises ValueError for an unknown component.
    """
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}")
    w = workload
    added = max(new - old, 0)
    if component == "rollout":
        return int(2.0 * w.model.num_params * added / w.rollout.tp)
    if component == "inference":
        return int(2.0 * w.model.num_params * added / w.inference.tp)
    state = w.model.state_bytes
    sharded = state * w.model.sharded_state_fraction
    if w.migration.trainer_kind == "reboot":  # saved from the old GPUs, loaded on the new
        return int(
            (state - sharded) * (old + new) / w.trainer.tp + sharded * ((old > 0) + (new > 0))
        )
    if 0 in (old, new):  # a park or an unpark: every GPU's whole share crosses its host link
        return int((state - sharded) * (old + new) / w.trainer.tp + sharded)
    replicated = (state - sharded) * added / w.trainer.tp
    low, high = min(old, new), max(old, new)
    moved = sharded * (1.0 - low / high) if high else 0.0
    return int(replicated + moved)
