"""The records every layer shares: component reports in, decision and migration records out.

These are the data contract between the group managers (who aggregate per-worker metrics),
the scheduler (which reads reports and writes decisions), the coordinator (which writes
migration outcomes), the simulator (which produces reports in virtual time) and the ledger.
They are wire messages (``msgspec.Struct``, tagged, frozen, keyword-only) so that they
travel on the bus and land in ``events.jsonl`` as they are. A decision's reasons are typed
too (:mod:`dynarl.bus._decision_reasons`).
"""

from __future__ import annotations

import msgspec

from dynarl.bus._decision_reasons import CandidateReason, DecisionReason

__all__ = [
    "ComponentReport",
    "DecisionRecord",
    "MigrationRecord",
    "RejectedCandidate",
    "WorkerMetrics",
]


class WorkerMetrics(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One worker's metrics over one reporting interval, sent to its group manager.

    Managers aggregate these into one :class:`ComponentReport` per component per interval
    (``dynarl.sched`` holds the aggregation), so the controller's load does not grow with
    the number of workers.
    """

    component: str
    """Logical component the worker belongs to."""
    worker: int
    """Worker index within the component (its position in ``ComponentReport.utilization``)."""
    time: float
    """End of the interval, seconds on the job clock."""
    interval_s: float
    """Length of the interval, seconds."""
    utilization: float
    """Utilization in [0, 1] (rollout: active KV tokens / KV capacity)."""
    queue_depth: int = 0
    """Items waiting in this worker's input queue."""
    completed: int = 0
    """Items this worker completed during the interval."""
    in_flight: int = 0
    """Items running on this worker now."""
    interruptible: bool = True
    """Whether this worker is at an interruptible point now."""
    cache_hit_rate: float = 0.0
    """Share of prefill tokens served from the prefix cache, in [0, 1] (rollout engines)."""


class ComponentReport(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One component's metrics over one reporting interval, aggregated by its group manager.

    The controller receives one of these per component per interval, whatever the number
    of workers: per-worker detail is kept only where Stage 1 needs it (``utilization``).
    """

    component: str
    """Logical component name (the WorkerGroup's name)."""
    kind: str
    """A ``dynarl.ComponentKind`` value."""
    time: float
    """End of the interval, seconds on the job clock."""
    interval_s: float
    """Length of the interval the figures cover, seconds."""
    utilization: tuple[float, ...]
    """Per-worker utilization in [0, 1], in worker order (rollout: active KV tokens / capacity)."""
    queue_depth: int = 0
    """Items waiting in the component's input queues at the end of the interval."""
    throughput: float = 0.0
    """Items completed per second over the interval (tokens, samples: the component's unit)."""
    completed: int = 0
    """Items of the current iteration completed so far."""
    remaining: int = 0
    """Items of the current iteration not yet completed (queued or in flight)."""
    interruptible: bool = True
    """Whether the component is at an interruptible point (batch or query boundary) now."""
    iteration: int = 0
    """Training iteration (step) the figures belong to."""


class RejectedCandidate(msgspec.Struct, frozen=True, kw_only=True):
    """A candidate allocation the scheduler evaluated and did not commit."""

    allocation: dict[str, int]
    """Devices per component under this candidate."""
    predicted_throughput: float
    """Predicted pipeline throughput (minimum over components) under this candidate."""
    reason: CandidateReason
    """Why it was not committed (for instance :class:`~dynarl.bus.NotBetterAfterCost`)."""


class DecisionRecord(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One decision round of the scheduler, committed or not (ledger record)."""

    decision_id: str
    """Unique id; migrations carried out for it refer to it."""
    time: float
    """Job-clock time of the decision, seconds."""
    committed: bool
    """Whether a new allocation was committed."""
    reason: DecisionReason
    """Why it was committed or not (for instance :class:`~dynarl.bus.NoDonor`,
    :class:`~dynarl.bus.Commit`); ``str(reason)`` is the sentence."""
    old_allocation: dict[str, int]
    """Devices per component before the decision."""
    new_allocation: dict[str, int]
    """Devices per component after it (equal to ``old_allocation`` when not committed)."""
    donor: str | None = None
    """Component found over-provisioned by Stage 1, if any."""
    receivers: tuple[str, ...] = ()
    """Components given the freed devices."""
    predicted_bottleneck: str | None = None
    """Component predicted to limit the pipeline under the new allocation."""
    predicted_throughput_old: float = 0.0
    """Predicted pipeline throughput under the old allocation."""
    predicted_throughput_new: float = 0.0
    """Predicted pipeline throughput under the new allocation."""
    expected_gain_s: float = 0.0
    """Predicted iteration time saved, net of the migration cost, seconds."""
    migration_cost_s: float = 0.0
    """Predicted migration cost charged against the remaining iteration time, seconds."""
    migration_bytes: int = 0
    """Predicted bytes the migration moves."""
    rejected: tuple[RejectedCandidate, ...] = ()
    """Alternatives evaluated and not committed, with reasons."""
    realised_iteration_delta_s: float | None = None
    """Measured change of iteration time after a committed move, once known, seconds."""
    prediction_error: float | None = None
    """Relative error of the predicted pipeline throughput, once measured."""


class MigrationRecord(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The outcome of one migration (ledger record)."""

    migration_id: str
    """Unique id of the migration."""
    decision_id: str
    """Decision that caused it."""
    time: float
    """Job-clock time the outcome was known, seconds."""
    kind: str
    """A ``dynarl.MigrationKind`` value."""
    component: str
    """Component whose state moved."""
    src_devices: tuple[int, ...]
    """Devices the component held before."""
    dst_devices: tuple[int, ...]
    """Devices it holds after a commit (or would have held)."""
    outcome: str
    """``"committed"``, ``"rolled_back"`` or ``"failed"``."""
    reason: str = ""
    """Why it rolled back or failed; empty on commit."""
    bytes_moved: int = 0
    """Bytes that crossed devices."""
    pause_s: float = 0.0
    """Time the component could not make progress (interrupt to commit), seconds."""
    cache_loss_tokens: int = 0
    """Prefix-cache tokens lost (to be re-prefilled) because of the move."""
    realised_iteration_delta_s: float | None = None
    """Measured change of iteration time after the move, once known, seconds."""
    prediction_error: float | None = None
    """Relative error of the predicted throughput of the moved components, once known."""
