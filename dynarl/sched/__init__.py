"""The decision plane: pipeline hypergraph, donor detection, candidate evaluation, policies."""

from __future__ import annotations

from dynarl.sched._decision import (
    CostEstimate,
    DeviceMove,
    MigrationCost,
    Resize,
    StaticMigrationCost,
)
from dynarl.sched._device_placement import place
from dynarl.sched._events import (
    Clock,
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
from dynarl.sched._extract import ExtractedGraph, extract_graph
from dynarl.sched._graph import Affinity, HyperEdge, Hypergraph, HyperNode, Node
from dynarl.sched._hybrid import DynamicScheduleContext, HybridPolicy, build_policy, register_policy
from dynarl.sched._ledger import Ledger, LedgerRecord
from dynarl.sched._ledger_records import GraphFindingRecord, SafeModeRecord
from dynarl.sched._metrics import DynamicResourceMetrics, RolloutUtilization
from dynarl.sched._predictor import (
    ComponentProfile,
    ProfilePoint,
    RegressionPredictor,
    ThroughputPredictor,
)
from dynarl.sched._prefix_shadow import PrefixCache, PrefixShadow
from dynarl.sched._replicas import HybridController, HybridReplicas
from dynarl.sched._requests import (
    FifoPolicy,
    LeastAttainedServicePolicy,
    PriorityPolicy,
    QueuedRequest,
    RequestPolicy,
    RequestQueue,
    ToolMlfqPolicy,
)
from dynarl.sched._router import DataRouter, RoutedItem
from dynarl.sched._sched_config import SchedulerConfig
from dynarl.sched._scheduler import Scheduler
from dynarl.sched._series import plot_ledger
from dynarl.sched._summary import summarise_ledger
from dynarl.sched._summary_format import format_summary, summary_json
from dynarl.sched._telemetry import MetricsBuffer

__all__ = [
    "Affinity",
    "Clock",
    "ComponentProfile",
    "CostEstimate",
    "DataRouter",
    "DeviceMove",
    "DynamicResourceMetrics",
    "DynamicScheduleContext",
    "ExtractedGraph",
    "FifoPolicy",
    "GraphFindingRecord",
    "HybridController",
    "HybridPolicy",
    "HybridReplicas",
    "HyperEdge",
    "HyperNode",
    "Hypergraph",
    "LeastAttainedServicePolicy",
    "Ledger",
    "LedgerRecord",
    "ManualClock",
    "MetricsBuffer",
    "MigrationCommand",
    "MigrationCost",
    "MonotonicClock",
    "MoveOutcome",
    "Node",
    "OperatorCommand",
    "PrefixCache",
    "PrefixShadow",
    "PriorityPolicy",
    "ProfilePoint",
    "QueuedRequest",
    "QuotaChange",
    "RegressionPredictor",
    "RequestPolicy",
    "RequestQueue",
    "Resize",
    "RolloutUtilization",
    "RoutedItem",
    "SafeModeRecord",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerEvent",
    "StaticMigrationCost",
    "ThroughputPredictor",
    "Tick",
    "ToolMlfqPolicy",
    "build_policy",
    "extract_graph",
    "format_summary",
    "place",
    "plot_ledger",
    "queued_batches",
    "register_policy",
    "summarise_ledger",
    "summary_json",
]
