"""The decision plane: pipeline hypergraph, donor detection, candidate evaluation, policies."""

from __future__ import annotations

from dynarl.sched.candidates import (
    Evaluation,
    assess,
    evaluate,
)
from dynarl.sched.config import (
    Estimator,
    PredictorConfig,
    SchedulerConfig,
)
from dynarl.sched.decision import (
    Candidate,
    CostEstimate,
    Decision,
    DeviceMove,
    MigrationCost,
    Rejection,
    Resize,
    StaticMigrationCost,
)
from dynarl.sched.effects import (
    MoveEffects,
    Realised,
)
from dynarl.sched.events import (
    Clock,
    CommandSink,
    ManualClock,
    MigrationCommand,
    MonotonicClock,
    MoveOutcome,
    OperatorCommand,
    QuotaChange,
    SchedulerEvent,
    Tick,
    queued_batches,
)
from dynarl.sched.extract import (
    ChannelUse,
    ExtractedComponent,
    ExtractedEdge,
    ExtractedGraph,
    UnresolvedSite,
    extract_graph,
)
from dynarl.sched.graph import (
    Affinity,
    HyperEdge,
    Hypergraph,
    HyperNode,
    Node,
)
from dynarl.sched.hybrid import (
    DefaultHybridPolicy,
    DynamicScheduleContext,
    FixedRatioPolicy,
    HybridPolicy,
    StaticFullyAsyncPolicy,
    build_policy,
    register_policy,
    registered_policies,
)
from dynarl.sched.ledger import (
    Ledger,
    LedgerRecord,
    RecordKind,
)
from dynarl.sched.metrics import (
    DynamicResourceMetrics,
    RolloutUtilization,
    resource_utilization,
    rollout_capacity,
    rollout_resource_utilization,
    train_compute_time,
    train_resource_utilization,
)
from dynarl.sched.placement import (
    place,
    release_devices,
)
from dynarl.sched.planner import (
    Safety,
    decide,
    hold,
)
from dynarl.sched.predictor import (
    ComponentProfile,
    ProfilePoint,
    RegressionPredictor,
    ThroughputPredictor,
    fit_power_law,
)
from dynarl.sched.quota import (
    QuotaPlan,
    plan_quota_change,
)
from dynarl.sched.records import (
    ComponentObservation,
    ObservationRecord,
    RoundsRecord,
    SafeModeRecord,
)
from dynarl.sched.replicas import (
    HybridController,
    HybridReplicas,
    HybridState,
    StepTimings,
)
from dynarl.sched.report import (
    format_summary,
    summary_json,
)
from dynarl.sched.requests import (
    FifoPolicy,
    LeastAttainedServicePolicy,
    PriorityPolicy,
    QueuedRequest,
    RequestPolicy,
    RequestQueue,
)
from dynarl.sched.router import (
    DataRouter,
    RoutedItem,
    Routing,
)
from dynarl.sched.scheduler import (
    Scheduler,
)
from dynarl.sched.series import (
    LedgerSeries,
    ledger_series,
    plot_ledger,
)
from dynarl.sched.summary import (
    ComponentUsage,
    Distribution,
    IterationSpan,
    LedgerSummary,
    MigrationStats,
    MoveSummary,
    SafeModeEpisode,
    reason_category,
    summarise_ledger,
)
from dynarl.sched.telemetry import (
    MetricsBuffer,
    aggregate_metrics,
)
from dynarl.sched.window import (
    ComponentStats,
    DonorSignal,
    WindowSet,
    detect_donors,
)

__all__ = [
    "Affinity",
    "Candidate",
    "ChannelUse",
    "Clock",
    "CommandSink",
    "ComponentObservation",
    "ComponentProfile",
    "ComponentStats",
    "ComponentUsage",
    "CostEstimate",
    "DataRouter",
    "Decision",
    "DefaultHybridPolicy",
    "DeviceMove",
    "Distribution",
    "DonorSignal",
    "DynamicResourceMetrics",
    "DynamicScheduleContext",
    "Estimator",
    "Evaluation",
    "ExtractedComponent",
    "ExtractedEdge",
    "ExtractedGraph",
    "FifoPolicy",
    "FixedRatioPolicy",
    "HybridController",
    "HybridPolicy",
    "HybridReplicas",
    "HybridState",
    "HyperEdge",
    "HyperNode",
    "Hypergraph",
    "IterationSpan",
    "LeastAttainedServicePolicy",
    "Ledger",
    "LedgerRecord",
    "LedgerSeries",
    "LedgerSummary",
    "ManualClock",
    "MetricsBuffer",
    "MigrationCommand",
    "MigrationCost",
    "MigrationStats",
    "MonotonicClock",
    "MoveEffects",
    "MoveOutcome",
    "MoveSummary",
    "Node",
    "ObservationRecord",
    "OperatorCommand",
    "PredictorConfig",
    "PriorityPolicy",
    "ProfilePoint",
    "QueuedRequest",
    "QuotaChange",
    "QuotaPlan",
    "Realised",
    "RecordKind",
    "RegressionPredictor",
    "Rejection",
    "RequestPolicy",
    "RequestQueue",
    "Resize",
    "RolloutUtilization",
    "RoundsRecord",
    "RoutedItem",
    "Routing",
    "SafeModeEpisode",
    "SafeModeRecord",
    "Safety",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerEvent",
    "StaticFullyAsyncPolicy",
    "StaticMigrationCost",
    "StepTimings",
    "ThroughputPredictor",
    "Tick",
    "UnresolvedSite",
    "WindowSet",
    "aggregate_metrics",
    "assess",
    "build_policy",
    "decide",
    "detect_donors",
    "evaluate",
    "extract_graph",
    "fit_power_law",
    "format_summary",
    "hold",
    "ledger_series",
    "place",
    "plan_quota_change",
    "plot_ledger",
    "queued_batches",
    "reason_category",
    "register_policy",
    "registered_policies",
    "release_devices",
    "resource_utilization",
    "rollout_capacity",
    "rollout_resource_utilization",
    "summarise_ledger",
    "summary_json",
    "train_compute_time",
    "train_resource_utilization",
]
