"""What the scheduler measures after it commits a move, what it learns from it, and what it
observes every round.

**Realised effect of a move.** A committed decision predicts how long the pipeline needs
for the work it knows of — each component's remaining items ``W_c`` (rollout: every
unfinished sample; a downstream stage: its backlog) at its predicted rate, the slowest
one setting the time — under the new allocation (``Candidate.remaining_s`` plus the
migration cost) and under the old one (the current allocation's ``remaining_s``).
:class:`MoveEffects` measures every committed move on the same terms: it notes, for each
component with items left, the completed count it must reach (completed plus remaining
at the decision); that component's realised time ``T_c`` is when it got there (within one
report interval; an iteration's end, seen as the first report of a later iteration,
ends every measurement of it), and the move's realised time is the slowest ``T_c``.
Without the move, a component it did not resize would have taken the same ``T_c``; one it
resized, ``T_c`` times its predicted time at the old size over that at the new one (so a
level the predictor got wrong for both sizes cancels out; an unbounded ratio, from a size
that could not finish, leaves the effect unknown). From these:

- ``prediction_error = realised / predicted − 1``: the relative error of the predicted
  pipeline throughput (positive: the move was predicted faster than it turned out);
- ``realised_iteration_delta_s = realised − realised without the move``: negative when the
  iteration ended that much earlier for the move, so ``−delta`` is the realised gain,
  comparable with the decision's ``expected_gain_s`` (equal to it when every prediction
  held). Only when, at the decision, no component was still to receive items (every
  predecessor of every component done): then the work known is the iteration's rest.
  Before that (a trainer's backlog while rollout still runs) the work still to come
  decides what a move was worth, and no measurement of the known work can say it; the
  delta stays None, as it does when the time without the move is unbounded.

Each move is measured on its own, moves of one iteration overlapping. A move that fails is
forgotten.

**Feedback.** :class:`LossRule` keeps, per component, the realised deltas of the moves that
resized it in the last ``num_loss_iterations`` iterations (k); a loss is charged only to
the resized components whose own work took longer than predicted (the predictions the loss
proves wrong), a gain to every resized one. A component whose moves there add up to a
loss (their deltas sum above zero: they cost more than they gained) is *held*: Stage 2
neither takes devices from it nor gives it any, so a persistent loss cannot repeat every
iteration. It is released once its median prediction error (the predictor's, over at
least ``num_error_samples`` reports) has fallen below ``release_error_fraction`` of what
it was when it was held; its record then starts afresh (held at a nil error, it stays
held).

**Observations.** :func:`observe` turns the round's component snapshot into an
:class:`~dynarl.sched._ledger_records.ObservationRecord`. Pure state; runs in the
scheduler's loop.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from dynarl.bus import ComponentReport
from dynarl.sched._decision import Decision
from dynarl.sched._graph import HyperNode
from dynarl.sched._ledger_records import ComponentObservation, ObservationRecord
from dynarl.sched._sched_config import SchedulerConfig
from dynarl.sched._window import ComponentStats
from dynarl.types import Allocation

__all__ = ["LossRule", "MoveEffects", "Realised", "observe"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Realised:
    """The measured effect of one committed decision."""

    decision_id: str
    iteration: int
    """Iteration the move was made in."""
    components: tuple[str, ...]
    """Components the move resized, sorted."""
    overran: tuple[str, ...] = ()
    """Those of them whose own work took longer than predicted under the move."""
    realised_s: float
    """Seconds from the decision until the work it knew of was done."""
    realised_iteration_delta_s: float | None
    """``realised_s`` minus the old allocation's predicted remaining time (None: unbounded)."""
    prediction_error: float | None
    """``realised_s`` over the predicted remaining time under the move, minus 1."""


@dataclass(slots=True)
class _Pending:
    decision_id: str
    time: float
    iteration: int
    predicted_s: float
    baseline_s: float
    components: tuple[str, ...]
    targets: dict[str, int]
    """Completed count each component with items left must reach."""
    predicted: dict[str, float]
    """Per resized component with items left: its predicted time at the new size,
    migration included."""
    ratios: dict[str, float]
    """Per resized component with items left: its predicted time at the old size over
    its predicted time at the new one."""
    complete: bool
    """No component was still to receive items: the targets are the iteration's rest."""
    reached: dict[str, float] = field(default_factory=dict)

    def close(self, end: float) -> Realised:
        times = {n: self.reached.get(n, end) - self.time for n in self.targets}
        realised_s = max(max(times.values(), default=0.0), 0.0)
        without = max((t * self.ratios.get(n, 1.0) for n, t in times.items()), default=0.0)
        delta = None
        if self.complete and math.isfinite(without):
            delta = realised_s - max(without, 0.0)
        error = None
        if math.isfinite(self.predicted_s) and self.predicted_s > 0:
            error = realised_s / self.predicted_s - 1.0
        return Realised(
            decision_id=self.decision_id,
            iteration=self.iteration,
            components=self.components,
            overran=tuple(n for n, p in sorted(self.predicted.items()) if times[n] > p),
            realised_s=realised_s,
            realised_iteration_delta_s=delta,
            prediction_error=error,
        )


class MoveEffects:
    """Measures the realised effect of committed moves (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []

    @property
    def pending(self) -> tuple[str, ...]:
        """Decision ids of the moves still being measured, oldest first."""
        return tuple(p.decision_id for p in self._pending)

    def committed(
        self,
        decision_id: str,
        decision: Decision,
        stats: Mapping[str, ComponentStats],
        nodes: Mapping[str, HyperNode],
    ) -> None:
        """A decision committed: measure it from now on."""
        if decision.chosen is None:
            return
        iteration = max((s.iteration for s in stats.values()), default=0)

        def waiting(name: str) -> bool:  # items of the iteration still to reach ``name``
            preds = nodes[name].predecessors if name in nodes else ()
            return any(p in stats and stats[p].remaining > 0 for p in preds)

        old = dict(decision.current.sizes)
        targets = {
            name: s.completed + s.remaining
            for name, s in sorted(stats.items())
            if s.remaining > 0 and s.iteration == iteration
        }
        before = dict(decision.current.throughput)
        after = dict(decision.chosen.throughput)
        cost = decision.chosen.cost_s
        predicted, ratios = {}, {}
        for name, size in decision.chosen.sizes:
            if size != old.get(name) and name in targets and name in after:
                work = float(stats[name].remaining)
                predicted[name] = (work / after[name] if after[name] > 0 else math.inf) + cost
                old_s = work / before[name] if before.get(name) else math.inf
                ratios[name] = old_s / predicted[name]
        self._pending.append(
            _Pending(
                decision_id=decision_id,
                time=decision.time,
                iteration=iteration,
                predicted_s=decision.chosen.remaining_s + decision.chosen.cost_s,
                baseline_s=decision.current.remaining_s,
                components=tuple(n for n, size in decision.chosen.sizes if size != old.get(n)),
                targets=targets,
                predicted=predicted,
                ratios=ratios,
                complete=not any(waiting(name) for name in stats),
            )
        )

    def failed(self, decision_id: str) -> None:
        """The move of ``decision_id`` failed: nothing of it is measured."""
        self._pending = [p for p in self._pending if p.decision_id != decision_id]

    def observe(self, report: ComponentReport) -> list[Realised]:
        """Fold in a report; the effects of the moves whose measurement it completes."""
        done, left = [], []
        for p in self._pending:
            if report.iteration > p.iteration:
                done.append(p.close(report.time))
                continue
            target = p.targets.get(report.component)
            if target is not None and report.component not in p.reached:
                if report.iteration == p.iteration and report.completed >= target:
                    p.reached[report.component] = report.time
            if len(p.reached) == len(p.targets):
                done.append(p.close(report.time))
            else:
                left.append(p)
        self._pending = left
        return done


class LossRule:
    """Holds components whose recent moves lost time (see the module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._deltas: dict[str, deque[tuple[int, float]]] = {}
        self._held: dict[str, float] = {}

    @property
    def held(self) -> dict[str, float]:
        """Held components and their median prediction error when they were held."""
        return dict(self._held)

    def record(self, realised: Realised, errors: Mapping[str, tuple[float, int]]) -> list[str]:
        """Fold in a measured move; returns the components it newly holds."""
        k = self.config.num_loss_iterations
        delta = realised.realised_iteration_delta_s
        if k == 0 or delta is None:
            return []
        newly = []
        for name in realised.components:
            if delta > 0.0 and name not in realised.overran:
                continue  # its own prediction held: the loss is not its moves'
            deltas = self._deltas.setdefault(name, deque())
            deltas.append((realised.iteration, delta))
            while deltas[0][0] <= realised.iteration - k:
                deltas.popleft()
            lost = sum(d for _, d in deltas)
            if lost > 0.0 and name not in self._held:
                self._held[name] = errors.get(name, (0.0, 0))[0]
                newly.append(name)
                logger.warning(
                    "%s held: its moves of the last %d iteration(s) lost %.1f s net "
                    "(prediction error %.3f)",
                    name,
                    k,
                    lost,
                    self._held[name],
                )
        return newly

    def release(self, errors: Mapping[str, tuple[float, int]]) -> list[str]:
        """Release every held component whose prediction error has fallen enough."""
        released = []
        for name, at_hold in sorted(self._held.items()):
            error, count = errors.get(name, (0.0, 0))
            enough = count >= self.config.num_error_samples
            if enough and error < self.config.release_error_fraction * at_hold:
                del self._held[name]
                self._deltas.pop(name, None)
                released.append(name)
                logger.info(
                    "%s released: prediction error %.3f, held at %.3f", name, error, at_hold
                )
        return released


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
