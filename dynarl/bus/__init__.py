"""The message bus: typed messages, ZeroMQ and in-process transports, user declarations."""

from __future__ import annotations

from dynarl.bus.records import (
    ComponentReport,
    DecisionRecord,
    MigrationRecord,
    RejectedCandidate,
    WorkerMetrics,
)

__all__ = [
    "ComponentReport",
    "DecisionRecord",
    "MigrationRecord",
    "RejectedCandidate",
    "WorkerMetrics",
]
