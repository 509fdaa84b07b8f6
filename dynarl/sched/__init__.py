"""The decision plane: pipeline hypergraph, donor detection, candidate evaluation, policies."""

from __future__ import annotations

from dynarl.sched.candidates import (
    Evaluation,
    assess,
    evaluate,
)
from dynarl.sched.config import (
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
from dynarl.sched.placement import (
    place,
)
from dynarl.sched.planner import (
    decide,
    hold,
)
from dynarl.sched.predictor import (
    ComponentProfile,
    PredictorConfig,
    ProfilePoint,
    RegressionPredictor,
    ThroughputPredictor,
    fit_power_law,
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
    "ComponentProfile",
    "ComponentStats",
    "CostEstimate",
    "Decision",
    "DeviceMove",
    "DonorSignal",
    "Evaluation",
    "ExtractedComponent",
    "ExtractedEdge",
    "ExtractedGraph",
    "HyperEdge",
    "HyperNode",
    "Hypergraph",
    "MetricsBuffer",
    "MigrationCost",
    "Node",
    "PredictorConfig",
    "ProfilePoint",
    "RegressionPredictor",
    "Rejection",
    "Resize",
    "SchedulerConfig",
    "StaticMigrationCost",
    "ThroughputPredictor",
    "UnresolvedSite",
    "WindowSet",
    "aggregate_metrics",
    "assess",
    "decide",
    "detect_donors",
    "evaluate",
    "extract_graph",
    "fit_power_law",
    "hold",
    "place",
]
