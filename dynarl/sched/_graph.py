"""The pipeline hypergraph: components (hypernodes), their workers (nodes), dataflow edges.

A :class:`HyperNode` is one logical component (rollout, inference, reward, tool, trainer)
with its static facts (kind, interruptibility, elastic bounds, minimum unit, valid
data-parallel sizes, state size) and its dynamic ones (workers, their devices and
utilization). A :class:`HyperEdge` is a dataflow between two components over one channel,
with its progress and worker-affinity mode. Every one of them is a frozen snapshot; the
:class:`Hypergraph` registry replaces snapshots as registrations arrive, so a decision
function always reads a consistent picture. Runs on the controller, in the scheduler's loop.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from dynarl.types import ComponentKind, MigrationKind

__all__ = ["Affinity", "HyperEdge", "HyperNode", "Hypergraph", "Node"]


class Affinity(enum.StrEnum):
    """Whether data must, should, or need not go back to the worker that saw it last."""

    MUST = "must"
    PREFER = "prefer"
    NONE = "none"


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One homogeneous worker of a component."""

    worker: int
    """Worker index within its component."""
    devices: tuple[int, ...] = ()
    """Job-wide device ids the worker runs on."""
    memory_bytes: int = 0
    """Device memory the worker holds, bytes."""
    utilization: float = 0.0
    """Latest utilization in [0, 1] (rollout: active KV tokens / capacity)."""

    def __post_init__(self) -> None:
        if self.worker < 0:
            raise ValueError(f"Node.worker must be >= 0, got {self.worker}")
        if not 0.0 <= self.utilization <= 1.0:
            raise ValueError(f"Node.utilization must be in [0, 1], got {self.utilization}")


@dataclass(frozen=True, kw_only=True, slots=True)
class HyperNode:
    """One logical component of the pipeline and the constraints on resizing it."""

    name: str
    """Component name (the WorkerGroup's name)."""
    kind: ComponentKind
    """The role the component plays."""
    migration: MigrationKind = MigrationKind.WORKLOAD
    """How its resources move; P2P components keep old and new state while they move."""
    interruptible: bool = True
    """Whether the component ever reaches an interruptible point (else it is never resized)."""
    min_devices: int = 0
    """Lower elastic bound, devices (a multiple of the unit, or 0)."""
    parkable: bool = False
    """May hold no device: its state waits in host memory; 0 is then a valid size besides
    min_devices and above (moving to or from 0 is a park or an unpark)."""
    max_devices: int | None = None
    """Upper elastic bound, devices (None: the whole job)."""
    tp: int = 1
    """Tensor-parallel size: one TP group always sits inside one node."""
    pp: int = 1
    """Pipeline-parallel size; a replica (the minimum unit) is tp × pp devices."""
    dp_sizes: tuple[int, ...] = ()
    """Valid data-parallel sizes, ascending (empty: any)."""
    state_bytes: int = 0
    """Bytes of one full replica's state (parameters, gradients, optimizer moments)."""
    sharded_state_fraction: float = 0.0
    """Part of the state sharded over data-parallel ranks (distributed optimizer)."""
    predecessors: tuple[str, ...] = ()
    """Components that feed this one, sorted."""
    successors: tuple[str, ...] = ()
    """Components this one feeds, sorted."""
    workers: tuple[Node, ...] = ()
    """Registered workers, by worker index."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("HyperNode.name must not be empty")
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"HyperNode {self.name!r}: tp and pp must be >= 1")
        if self.min_devices < 0 or self.min_devices % self.unit:
            raise ValueError(
                f"HyperNode {self.name!r}: min_devices {self.min_devices} must be a "
                f"non-negative multiple of the unit {self.unit}"
            )
        if self.max_devices is not None and self.max_devices < max(self.min_devices, 1):
            raise ValueError(
                f"HyperNode {self.name!r}: max_devices {self.max_devices} is below "
                f"max(min_devices, 1)"
            )
        if list(self.dp_sizes) != sorted(set(self.dp_sizes)) or any(d < 1 for d in self.dp_sizes):
            raise ValueError(
                f"HyperNode {self.name!r}: dp_sizes must be ascending positive ints, "
                f"got {self.dp_sizes}"
            )
        if self.state_bytes < 0 or not 0.0 <= self.sharded_state_fraction <= 1.0:
            raise ValueError(f"HyperNode {self.name!r}: bad state_bytes or sharded fraction")

    @property
    def unit(self) -> int:
        """Devices of one replica (tp × pp): the minimum unit of a move."""
        return self.tp * self.pp

    @property
    def num_devices(self) -> int:
        """Devices its registered workers hold."""
        return sum(len(node.devices) for node in self.workers)

    @property
    def zero_allowed(self) -> bool:
        """Whether 0 devices is a valid size (no minimum, or a parkable component)."""
        return self.min_devices == 0 or self.parkable

    def upper_bound(self, total: int) -> int:
        """Largest size allowed in a job of ``total`` devices."""
        return total if self.max_devices is None else min(total, self.max_devices)

    def is_valid_size(self, num_devices: int) -> bool:
        """Whether the component may hold exactly ``num_devices`` devices."""
        if num_devices == 0:
            return self.zero_allowed
        if num_devices < self.min_devices or num_devices % self.unit:
            return False
        if self.max_devices is not None and num_devices > self.max_devices:
            return False
        return not self.dp_sizes or num_devices // self.unit in self.dp_sizes

    def valid_sizes(self, low: int, high: int, max_points: int) -> tuple[int, ...]:
        """Valid sizes in [low, high], ascending: all of them, or ``max_points`` spread out.

        The spread keeps both ends and spaces the rest geometrically from each end, so
        small moves and large ones are both represented whatever the GPU count.
        """
        high = min(high, self.max_devices if self.max_devices is not None else high)
        low = max(low, 0)
        sizes: list[int] = [0] if low == 0 and self.zero_allowed else []
        lo_dp = max(1, math.ceil(max(low, self.min_devices) / self.unit))
        hi_dp = high // self.unit
        if self.dp_sizes:
            dps = [d for d in self.dp_sizes if lo_dp <= d <= hi_dp]
            if len(dps) > max_points:
                dps = [dps[i] for i in _spread(len(dps), max_points)]
        elif hi_dp - lo_dp + 1 <= max_points:
            dps = list(range(lo_dp, hi_dp + 1))
        else:
            dps = [lo_dp + i for i in _spread(hi_dp - lo_dp + 1, max_points)]
        unit = self.unit
        sizes.extend(d * unit for d in dps)
        return tuple(sizes)

    def num_valid_sizes(self, low: int, high: int) -> int:
        """How many valid sizes lie in [low, high] (what :meth:`valid_sizes` may thin out)."""
        high = min(high, self.max_devices if self.max_devices is not None else high)
        lo_dp = max(1, math.ceil(max(low, self.min_devices) / self.unit))
        hi_dp = high // self.unit
        zero = 1 if max(low, 0) == 0 and self.zero_allowed else 0
        if self.dp_sizes:
            return zero + sum(1 for d in self.dp_sizes if lo_dp <= d <= hi_dp)
        return zero + max(0, hi_dp - lo_dp + 1)

    def bytes_per_device(self, num_devices: int) -> float:
        """State bytes one device holds when the component has ``num_devices`` devices."""
        if num_devices == 0 or self.state_bytes == 0:
            return 0.0
        dp = num_devices // self.unit
        share = (1.0 - self.sharded_state_fraction) + self.sharded_state_fraction / dp
        return self.state_bytes / self.unit * share


@dataclass(frozen=True, kw_only=True, slots=True)
class HyperEdge:
    """Dataflow from one component to another over a channel."""

    src: str
    """Producing component."""
    dst: str
    """Consuming component."""
    channel: str
    """Channel the data travels on."""
    affinity: Affinity = Affinity.NONE
    """Whether items go back to the worker that handled their episode last."""
    produced: int = 0
    """Items put on the edge in the current iteration."""
    consumed: int = 0
    """Items taken off it in the current iteration."""

    @property
    def progress(self) -> float:
        """Fraction of the produced items already consumed (1.0 when nothing is pending)."""
        return 1.0 if self.produced == 0 else self.consumed / self.produced


@dataclass(slots=True)
class Hypergraph:
    """Registry of the pipeline's hypernodes and hyperedges.

    Built from user declarations or from :func:`dynarl.sched.extract_graph`, then
    completed at run time by worker registration. Not thread-safe: the scheduler's loop
    owns it. Raises ValueError for unknown or duplicate names.
    """

    _nodes: dict[str, HyperNode] = field(default_factory=dict)
    _edges: dict[tuple[str, str, str], HyperEdge] = field(default_factory=dict)

    @classmethod
    def of(cls, nodes: Iterable[HyperNode], edges: Iterable[HyperEdge] = ()) -> Hypergraph:
        """A graph of ``nodes`` joined by ``edges``."""
        graph = cls()
        for node in nodes:
            graph.add_component(node)
        for edge in edges:
            graph.connect(edge)
        return graph

    def add_component(self, node: HyperNode) -> None:
        """Register a component; raises ValueError if the name is taken."""
        if node.name in self._nodes:
            raise ValueError(f"component {node.name!r} is already registered")
        self._nodes[node.name] = replace(node, predecessors=(), successors=())
        for edge in self._edges.values():
            if node.name in (edge.src, edge.dst):
                self._link(edge.src, edge.dst)

    def connect(self, edge: HyperEdge) -> None:
        """Register a dataflow edge; raises ValueError naming an unknown endpoint."""
        for end in (edge.src, edge.dst):
            if end not in self._nodes:
                raise ValueError(f"edge {edge.src}->{edge.dst} names unknown component {end!r}")
        self._edges[(edge.src, edge.dst, edge.channel)] = edge
        self._link(edge.src, edge.dst)

    def _link(self, src: str, dst: str) -> None:
        a, b = self._nodes[src], self._nodes[dst]
        self._nodes[src] = replace(a, successors=tuple(sorted({*a.successors, dst})))
        b = self._nodes[dst]
        self._nodes[dst] = replace(b, predecessors=tuple(sorted({*b.predecessors, src})))

    def register_worker(self, component: str, node: Node) -> None:
        """Add or replace one worker of ``component``."""
        current = self.component(component)
        others = [w for w in current.workers if w.worker != node.worker]
        workers = tuple(sorted([*others, node], key=lambda w: w.worker))
        self._nodes[component] = replace(current, workers=workers)

    def set_workers(self, component: str, workers: Iterable[Node]) -> None:
        """Replace every worker of ``component`` at once (after a move re-formed them).

        Raises ValueError for an unknown component or a repeated worker index.
        """
        current = self.component(component)
        ordered = tuple(sorted(workers, key=lambda w: w.worker))
        if len({w.worker for w in ordered}) != len(ordered):
            raise ValueError(f"{component}: repeated worker index")
        self._nodes[component] = replace(current, workers=ordered)

    def unregister_worker(self, component: str, worker: int) -> None:
        """Drop one worker of ``component`` (after a move took its devices)."""
        current = self.component(component)
        workers = tuple(w for w in current.workers if w.worker != worker)
        self._nodes[component] = replace(current, workers=workers)

    def update_utilization(self, component: str, utilization: Mapping[int, float]) -> None:
        """Set the latest utilization of some workers of ``component``."""
        current = self.component(component)
        workers = tuple(
            replace(w, utilization=utilization[w.worker]) if w.worker in utilization else w
            for w in current.workers
        )
        self._nodes[component] = replace(current, workers=workers)

    def record_progress(
        self, src: str, dst: str, channel: str, *, produced: int = 0, consumed: int = 0
    ) -> HyperEdge:
        """Add produced/consumed counts to an edge; raises ValueError if it is unknown."""
        key = (src, dst, channel)
        if key not in self._edges:
            raise ValueError(f"no edge {src}->{dst} on channel {channel!r}")
        edge = self._edges[key]
        edge = replace(edge, produced=edge.produced + produced, consumed=edge.consumed + consumed)
        self._edges[key] = edge
        return edge

    def reset_progress(self) -> None:
        """Zero every edge's progress (at an iteration boundary)."""
        self._edges = {k: replace(e, produced=0, consumed=0) for k, e in self._edges.items()}

    def component(self, name: str) -> HyperNode:
        """The component called ``name``; raises ValueError if unknown."""
        try:
            return self._nodes[name]
        except KeyError:
            raise ValueError(f"unknown component {name!r}") from None

    @property
    def components(self) -> tuple[HyperNode, ...]:
        """Every component, by name."""
        return tuple(self._nodes[name] for name in sorted(self._nodes))

    @property
    def edges(self) -> tuple[HyperEdge, ...]:
        """Every edge, by (src, dst, channel)."""
        return tuple(self._edges[key] for key in sorted(self._edges))

    def predecessors(self, name: str) -> tuple[str, ...]:
        """Components feeding ``name``."""
        return self.component(name).predecessors

    def successors(self, name: str) -> tuple[str, ...]:
        """Components fed by ``name``."""
        return self.component(name).successors

    def __contains__(self, name: object) -> bool:
        return name in self._nodes


def _spread(count: int, max_points: int) -> list[int]:
    """At most ``max_points`` indices in [0, count): both ends, geometric steps from each."""
    if count <= max_points:
        return list(range(count))
    half = max(1, (max_points - 2) // 2)
    last = count - 1
    picked = {0, last}
    for i in range(half):
        offset = round(last ** (i / max(half - 1, 1)))
        picked.update((offset, last - offset))
    return sorted(picked)
