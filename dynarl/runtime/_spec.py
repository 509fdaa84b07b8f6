"""What a job is made of: its components (:class:`ComponentSpec`) and the runtime's settings
(:class:`RuntimeConfig`).

A component is a user ``WorkerGroup`` subclass (the role its workers host), the devices it
holds at the start, its options (passed to every role instance), how its devices move
(by default: workload migration for serving components, P2P for a trainer whose role
can reshard, reboot otherwise) and what the scheduler knows of it beforehand (profile,
elastic bounds). Pure data; built by the user, read by the controller.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dynarl.bus import MetaValue, WorkerGroup
from dynarl.migrate import Layout
from dynarl.runtime._faults import Fault
from dynarl.sched import (
    ComponentProfile,
    HyperEdge,
    Hypergraph,
    HyperNode,
    PrefixCache,
    RequestPolicy,
    SchedulerConfig,
)
from dynarl.types import ComponentKind, MigrationKind

__all__ = ["ComponentSpec", "RuntimeConfig", "pipeline_graph"]

_SERVING_KINDS = frozenset(
    {ComponentKind.ROLLOUT, ComponentKind.INFERENCE, ComponentKind.REWARD, ComponentKind.TOOL}
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ComponentSpec:
    """One component of a job."""

    role: type[WorkerGroup]
    """The user's WorkerGroup subclass its workers host (importable by worker processes)."""
    devices: tuple[int, ...]
    """Devices it holds at the start (may be empty)."""
    options: Mapping[str, MetaValue] = field(default_factory=dict)
    """Options every role instance reads from ``ctx.options``."""
    migration: MigrationKind | None = None
    """How its devices move (None: chosen from its kind and what its role implements)."""
    output: str = ""
    """Channel its served results are put into (serving components; default: its name)."""
    inputs: tuple[str, ...] = ()
    """Components whose results it consumes: the pipeline's dataflow edges, which the
    scheduler plans with. While one of them has items of the iteration left, this component
    keeps a replica (its work keeps coming). Empty: the scheduler sees no edge into it."""
    profile: ComponentProfile | None = None
    """What the throughput predictor knows before the job runs."""
    layout: Callable[[tuple[int, ...]], Layout] | None = None
    """Its state's layout over given devices, for the cost model (None: the role class's
    ``plan_layout(options, devices)`` when it has one)."""
    min_devices: int | None = None
    """Fewest devices it may hold (None: the role's ``min_workers``)."""
    max_devices: int | None = None
    """Most devices it may hold (None: the role's ``max_workers``)."""
    max_inflight: int = 8
    """Items one worker serves at a time (serving components)."""
    keep_asleep: bool = True
    """Released roles sleep with their state (True) or are torn down (False)."""
    request_policy: RequestPolicy | None = None
    """Order of the items waiting for each worker (serving components; None: DynaRL's
    priority — completed tool calls, then cached prefix — with bounded overtaking)."""
    max_overtakes: int | None = 64
    """No waiting item is overtaken by more than this many later arrivals (None: no bound;
    ``Dispatcher.router.max_overtakes_seen`` says how many it took)."""
    prefix_cache: PrefixCache | None = None
    """The engines' prefix-cache layout (block size, capacity): the dispatcher then keeps a
    shadow of each engine's cache and keys waiting generation requests by the prefix it
    predicts cached (``Dispatcher.shadows.check``: predictions against reports). None: the
    items' own ``cached_prefix`` metadata."""

    def __post_init__(self) -> None:
        if not (isinstance(self.role, type) and issubclass(self.role, WorkerGroup)):
            raise ValueError(f"ComponentSpec.role must be a WorkerGroup subclass, got {self.role}")
        if list(self.devices) != sorted(set(self.devices)) or any(d < 0 for d in self.devices):
            raise ValueError(
                f"ComponentSpec.devices must be sorted, distinct, >= 0: {self.devices}"
            )
        if self.max_inflight < 1:
            raise ValueError(f"ComponentSpec.max_inflight must be >= 1, got {self.max_inflight}")
        if not isinstance(self.inputs, tuple) or not all(
            isinstance(n, str) and n for n in self.inputs
        ):
            raise ValueError(
                f"ComponentSpec.inputs must be a tuple of component names, got {self.inputs!r}"
            )
        if self.name in self.inputs:
            raise ValueError(f"ComponentSpec.inputs: component {self.name!r} names itself")
        if self.max_overtakes is not None and self.max_overtakes < 0:
            raise ValueError(
                f"ComponentSpec.max_overtakes must be >= 0 or None, got {self.max_overtakes}"
            )

    @property
    def name(self) -> str:
        """Component name (the role's declared name)."""
        return self.role.spec.name

    @property
    def kind(self) -> ComponentKind:
        """The role the component plays."""
        return self.role.spec.kind

    @property
    def serving(self) -> bool:
        """Whether its workers serve routed items (rollout, inference, reward, tools)."""
        return self.kind in _SERVING_KINDS and callable(getattr(self.role, "serve", None))

    @property
    def output_channel(self) -> str:
        """The channel its results go to."""
        return self.output or self.name

    @property
    def migration_kind(self) -> MigrationKind:
        """How its devices move."""
        if self.migration is not None:
            return self.migration
        if self.serving:
            return MigrationKind.WORKLOAD
        reshardable = all(
            callable(getattr(self.role, name, None))
            for name in ("layout", "shard_views", "allocate", "commit", "discard")
        )
        return MigrationKind.P2P if reshardable else MigrationKind.REBOOT

    def plan_layout(self) -> Callable[[tuple[int, ...]], Layout] | None:
        """The layout function the cost model uses, if any."""
        if self.layout is not None:
            return self.layout
        planner = getattr(self.role, "plan_layout", None)
        if planner is None:
            return None
        options = dict(self.options)
        return lambda devices: planner(options, devices)

    def node(self) -> HyperNode:
        """The scheduler's view of this component."""
        spec = self.role.spec
        unit = spec.min_unit
        low = self.min_devices if self.min_devices is not None else spec.min_workers
        high = self.max_devices if self.max_devices is not None else spec.max_workers
        return HyperNode(
            name=self.name,
            kind=self.kind,
            migration=self.migration_kind,
            interruptible=spec.interruptible,
            min_devices=low,
            max_devices=high,
            tp=unit,
        )


def pipeline_graph(specs: Sequence[ComponentSpec]) -> Hypergraph:
    """The scheduler's graph of a job: each component's node, an edge from every input.

    Raises ValueError naming a component whose inputs name no component of the job.
    """
    by_name = {spec.name: spec for spec in specs}
    edges = []
    for spec in specs:
        unknown = sorted(set(spec.inputs) - set(by_name))
        if unknown:
            raise ValueError(
                f"component {spec.name!r} has inputs {unknown} that are not components of "
                f"the job (components: {sorted(by_name)})"
            )
        edges += [
            HyperEdge(src=src, dst=spec.name, channel=by_name[src].output_channel)
            for src in spec.inputs
        ]
    return Hypergraph.of((spec.node() for spec in specs), edges)


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    """How the controller runs a job: liveness, intervals, deadlines, leases, faults."""

    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats (workers adopt the controller's setting)."""
    num_missed_heartbeats: int = 10
    """Silent intervals before a peer is lost: 10 s by default, so a worker whose
    interpreter stalls for seconds on a loaded 2-core machine is not declared lost."""
    metrics_interval_s: float = 0.5
    """Seconds between two WorkerMetrics of one worker."""
    report_interval_s: float = 1.0
    """Seconds between two ComponentReports of one manager."""
    start_timeout_s: float = 180.0
    """Deadline for every worker to register at start-up, and for a role to become active
    on a device (starting it may launch an engine server there), seconds."""
    request_timeout_s: float = 60.0
    """Deadline of a control request to a worker (activate, call, a migration step)."""
    item_timeout_s: float = 600.0
    """Deadline of one served item (generation), seconds."""
    drain_timeout_s: float = 30.0
    """Deadline for a donor's in-flight items to come back after an abort, seconds."""
    collective_timeout_s: float = 20.0
    """Deadline of group construction and of every network wait in a reshard, seconds."""
    lease_s: float = 120.0
    """Lease of every migration: forward steps after it fail and the move rolls back."""
    commit_margin_s: float = 2.0
    """A move commits only while every lease has at least this much left."""
    transfer_bytes_per_s: float = 200e6
    """Initial P2P transfer rate of the cost model (refined by measured moves)."""
    channel_capacity: int = 100_000
    """Bound of a component's output channel queue."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The decision plane's settings."""
    faults: tuple[Fault, ...] = ()
    """Faults to inject at named migration phases (tests)."""
    metrics_port: int | None = 0
    """Port of the controller's Prometheus endpoint: 0 (default) a free port, ``Job.metrics``
    has its URL, skipped with a warning when the ``metrics`` extra is not installed; a fixed
    port requires the extra; None: no endpoint."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds (loopback unless set: it has no authentication)."""
    pin_cores: bool = False
    """Each device is one CPU core: device ``d``'s worker, and every process it starts (an
    engine server), runs on the ``d``-th core this process may use; ``Job.core_usage()``
    and ``cores.json`` give each core's busy time. A job with more devices than cores is
    refused."""
    ledger_keep_recent: int = 4096
    """Most recent uncommitted-round and observation records (two per decision round) the
    controller's ledger keeps in memory; older ones are only in ``events.jsonl``."""

    def __post_init__(self) -> None:
        for name in (
            "heartbeat_interval_s",
            "metrics_interval_s",
            "report_interval_s",
            "start_timeout_s",
            "request_timeout_s",
            "item_timeout_s",
            "drain_timeout_s",
            "collective_timeout_s",
            "lease_s",
            "transfer_bytes_per_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"RuntimeConfig.{name} must be positive, got {value!r}")
        if self.commit_margin_s < 0 or self.commit_margin_s >= self.lease_s:
            raise ValueError("RuntimeConfig.commit_margin_s must be in [0, lease_s)")
        if self.num_missed_heartbeats < 1 or self.channel_capacity < 1:
            raise ValueError(
                "RuntimeConfig.num_missed_heartbeats and channel_capacity must be >= 1"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(
                f"RuntimeConfig.metrics_port must be in [0, 65535], got {self.metrics_port}"
            )
        if self.ledger_keep_recent < 1:
            raise ValueError(
                f"RuntimeConfig.ledger_keep_recent must be >= 1, got {self.ledger_keep_recent}"
            )
        if self.collective_timeout_s >= self.request_timeout_s:
            raise ValueError("RuntimeConfig.collective_timeout_s must be below request_timeout_s")
