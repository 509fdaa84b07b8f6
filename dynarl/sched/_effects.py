"""What the scheduler measures after it commits a move, and what it observes every round.

**Realised effect of a move.** A committed decision predicts the time its iteration still
needs under the new allocation (``Candidate.remaining_s`` plus the migration cost) and
under the old one (the current allocation's ``remaining_s``). :class:`MoveEffects` waits
for the iteration to end — the first report of a later iteration than any component was
in at the decision — and then knows the realised remaining time ``t_end − t_decision``
(within one report interval). From it:

- ``prediction_error = realised / predicted − 1``: the relative error of the predicted
  pipeline throughput (positive: the move was predicted faster than it turned out);
- ``realised_iteration_delta_s = realised − predicted without the move``: negative when the
  iteration ended that much earlier than the old allocation was predicted to finish, so
  ``−delta`` is the realised gain, comparable with the decision's ``expected_gain_s``.

Only the last committed move of an iteration is measured: a later commit in the same
iteration supersedes the earlier one (its prediction no longer describes what ran), and a
move that fails is forgotten. The counterfactual "without the move" is the prediction the
decision was made on; nothing else is observable.

**Observations.** :func:`observe` turns the round's component snapshot into an
:class:`~dynarl.sched._ledger_records.ObservationRecord`. Pure state; runs in the scheduler's loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from dynarl.bus import ComponentReport
from dynarl.sched._decision import Decision
from dynarl.sched._ledger_records import ComponentObservation, ObservationRecord
from dynarl.sched._window import ComponentStats
from dynarl.types import Allocation

__all__ = ["MoveEffects", "Realised", "observe"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Realised:
    """The measured effect of one committed decision."""

    decision_id: str
    realised_s: float
    """Seconds from the decision to the end of its iteration."""
    realised_iteration_delta_s: float | None
    """``realised_s`` minus the old allocation's predicted remaining time (None: unbounded)."""
    prediction_error: float | None
    """``realised_s`` over the predicted remaining time under the move, minus 1."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Pending:
    decision_id: str
    time: float
    iteration: int
    predicted_s: float
    baseline_s: float


class MoveEffects:
    """Measures the realised effect of committed moves (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: _Pending | None = None

    @property
    def pending(self) -> str | None:
        """Decision id of the move waiting for its iteration to end."""
        return self._pending.decision_id if self._pending is not None else None

    def committed(
        self, decision_id: str, decision: Decision, stats: Mapping[str, ComponentStats]
    ) -> None:
        """A decision committed: measure it at the end of the current iteration."""
        if decision.chosen is None:
            return
        self._pending = _Pending(
            decision_id=decision_id,
            time=decision.time,
            iteration=max((s.iteration for s in stats.values()), default=0),
            predicted_s=decision.chosen.remaining_s + decision.chosen.cost_s,
            baseline_s=decision.current.remaining_s,
        )

    def failed(self, decision_id: str) -> None:
        """The move of ``decision_id`` failed: nothing of it is measured."""
        if self._pending is not None and self._pending.decision_id == decision_id:
            self._pending = None

    def observe(self, report: ComponentReport) -> Realised | None:
        """Fold in a report; the pending move's effect once its iteration has ended."""
        pending = self._pending
        if pending is None or report.iteration <= pending.iteration:
            return None
        self._pending = None
        realised = max(report.time - pending.time, 0.0)
        delta = realised - pending.baseline_s if math.isfinite(pending.baseline_s) else None
        error = None
        if math.isfinite(pending.predicted_s) and pending.predicted_s > 0:
            error = realised / pending.predicted_s - 1.0
        return Realised(
            decision_id=pending.decision_id,
            realised_s=realised,
            realised_iteration_delta_s=delta,
            prediction_error=error,
        )


def observe(
    record_id: str,
    decision: Decision,
    stats: Mapping[str, ComponentStats],
    allocation: Allocation,
    num_free: int,
) -> ObservationRecord:
    """The round's snapshot of every reporting component."""
    predicted = dict(decision.current.throughput)
    components = {}
    for name, s in stats.items():
        util = s.latest.utilization
        components[name] = ComponentObservation(
            devices=allocation.count(name),
            utilization=sum(util) / len(util) if util else 0.0,
            queue_depth=s.queue_depth,
            throughput=s.latest.throughput,
            predicted_throughput=predicted.get(name, 0.0),
            remaining=s.remaining,
            iteration=s.iteration,
        )
    return ObservationRecord(
        record_id=record_id, time=decision.time, components=components, num_free=num_free
    )
