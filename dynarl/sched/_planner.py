"""One decision round as pure functions: the safety gates, then Stage 2.

Safety: a move may start only when the scheduler is not in safe mode, no move is in
flight, and at least ``min_move_interval_s`` has passed since the last move ended, unless
it takes devices only from donors that have finished their iteration's work
(:func:`finished_donors`: they idle until the next iteration whatever happens). Safe
mode freezes the last valid allocation (the pipeline runs on statically); it is entered
after ``max_failed_moves`` consecutive failed moves, when any component's median relative
prediction error exceeds ``max_prediction_error`` over at least ``num_error_samples``
samples, or on an operator command; it ends after ``safe_mode_cooldown_s`` or on an
operator command. Safe mode (unless an operator's) does not hold a **starved** component —
work left, no device — without one: such a round still takes Stage 2's choice if it lets
every component finish (:func:`unblock`). :class:`Safety` is
immutable; every transition returns a new one and nothing here reads a clock.

Stage 2: :func:`decide` ranks the candidates (see :mod:`dynarl.sched._candidates`), takes the best
one that saves strictly more than ``min_gain_s`` after its migration cost and whose TP
groups can stay node-local, and turns it into concrete device moves (a shrinking component
with registered workers gives up its least-utilized ones, by its latest report). :func:`hold` is the
round's record when the scheduler does not get as far as Stage 2 (no donor, safe mode,
minimum interval, a move in flight). Both read one :class:`~dynarl.sched._decision.RoundInput`
and give their reasons as the typed structs of :mod:`dynarl.bus._decision_reasons`. Runs in
the scheduler's loop or the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from dynarl.bus import (
    CandidateReason,
    Commit,
    DecisionReason,
    FinishesLater,
    HoldReason,
    InfeasiblePlacement,
    MinimumInterval,
    MoveInFlight,
    NotBetterAfterCost,
    Rejected,
    SafeMode,
    SavesLess,
)
from dynarl.errors import SchedulingError
from dynarl.sched._candidates import assess, evaluate
from dynarl.sched._decision import Candidate, Decision, DeviceMove, Rejection, RoundInput
from dynarl.sched._device_placement import place
from dynarl.sched._graph import HyperNode
from dynarl.sched._sched_config import SchedulerConfig
from dynarl.sched._window import ComponentStats, DonorSignal

__all__ = ["Safety", "decide", "finished_donors", "hold", "starved", "unblock"]


def decide(inputs: RoundInput) -> Decision:
    """Stage 2 over the round's donors (and any free devices): the round's :class:`Decision`."""
    evaluation = evaluate(inputs)
    chosen: Candidate | None = None
    moves: tuple[DeviceMove, ...] = ()
    rejected: list[Rejection] = []
    for cand in evaluation.candidates:
        reason: CandidateReason
        if chosen is not None:
            reason = _worse_than(cand, chosen)
        elif not cand.gain_s > inputs.config.min_gain_s:
            reason = NotBetterAfterCost(
                gain_s=cand.gain_s, cost_s=cand.cost_s, min_gain_s=inputs.config.min_gain_s
            )
        else:
            try:
                moves = _place(inputs, cand)
            except SchedulingError as err:
                reason = InfeasiblePlacement(detail=str(err))
            else:
                chosen = cand
                continue
        rejected.append(Rejection(candidate=cand, reason=reason))
    outcome: DecisionReason
    if chosen is not None:
        outcome = Commit(gain_s=chosen.gain_s, cost_s=chosen.cost_s, bottleneck=chosen.bottleneck)
    elif rejected:
        outcome = Rejected(why=rejected[0].reason)
    else:
        assert evaluation.note is not None, "no candidates without a note"
        outcome = Rejected(why=evaluation.note)
    return Decision(
        time=inputs.time,
        committed=chosen is not None,
        reason=outcome,
        old_allocation=inputs.allocation,
        current=evaluation.current,
        chosen=chosen,
        moves=moves,
        donors=tuple(d.component for d in inputs.donors),
        rejected=tuple(rejected),
        num_levels=evaluation.num_levels,
        exhaustive=evaluation.exhaustive,
    )


def _worse_than(cand: Candidate, chosen: Candidate) -> SavesLess | FinishesLater:
    """Why ``cand``, ranked after the ``chosen`` one, is not it."""
    if math.isfinite(chosen.gain_s):
        return SavesLess(gain_s=cand.gain_s, chosen_gain_s=chosen.gain_s)
    return FinishesLater(
        finish_s=cand.remaining_s + cand.cost_s, chosen_finish_s=chosen.remaining_s + chosen.cost_s
    )


def _place(inputs: RoundInput, cand: Candidate) -> tuple[DeviceMove, ...]:
    """The device moves that give ``cand`` its sizes; raises SchedulingError if none can."""
    return place(
        inputs.allocation,
        inputs.free,
        dict(cand.sizes),
        inputs.nodes,
        inputs.config.num_devices_per_node,
        load={name: s.latest.utilization for name, s in inputs.stats.items()},
    )


def finished_donors(
    donors: Sequence[DonorSignal],
    stats: Mapping[str, ComponentStats],
    nodes: Mapping[str, HyperNode],
    since: float,
) -> tuple[DonorSignal, ...]:
    """The donors whose iteration's work is done: no item left, none left upstream, as
    reports made after ``since`` (the end of the last move) say.

    Such a donor idles until the next iteration brings it work, so moving its devices
    disturbs nothing it runs: the minimum interval between moves does not hold it back.
    A report from before the last move may describe an iteration that has ended since.
    """

    def done(name: str) -> bool:
        return name in stats and stats[name].remaining <= 0 and stats[name].time > since

    return tuple(
        d
        for d in donors
        if done(d.component) and all(done(p) for p in nodes[d.component].predecessors)
    )


def starved(stats: Mapping[str, ComponentStats], counts: Mapping[str, int]) -> tuple[str, ...]:
    """Components with work left and no device: as the allocation stands, the job cannot
    finish."""
    return tuple(sorted(n for n, s in stats.items() if s.remaining > 0 and not counts.get(n)))


def unblock(inputs: RoundInput, held: Decision) -> Decision:
    """A held round's decision when a component is starved: Stage 2's choice if it lets
    every component finish (an unbounded gain: :mod:`dynarl.sched._candidates`), else
    ``held``. Safe mode keeps a running pipeline as it is; it must not keep a component
    without the device it needs to finish (found on real SGLang: a scorer whose device
    the rollout held waited out a 300 s cool-down)."""
    decision = decide(inputs)
    if decision.chosen is not None and math.isinf(decision.chosen.gain_s):
        return decision
    return held


def hold(reason: DecisionReason, inputs: RoundInput) -> Decision:
    """A round that commits nothing for ``reason``, with the current predicted numbers."""
    return Decision(
        time=inputs.time,
        committed=False,
        reason=reason,
        old_allocation=inputs.allocation,
        current=assess(inputs),
        donors=tuple(d.component for d in inputs.donors),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Safety:
    """Where the scheduler stands with respect to its safety rules."""

    safe_since: float | None = None
    """When safe mode began (None: not in safe mode)."""
    safe_reason: str = ""
    """Why it is in safe mode."""
    operator_hold: bool = False
    """Safe mode was entered by an operator: only an operator ends it."""
    failures: int = 0
    """Consecutive failed moves."""
    last_move_end: float = -math.inf
    """When the last move (or its failure) was reported."""
    in_flight: str | None = None
    """Decision id of the move being carried out."""

    @property
    def safe(self) -> bool:
        """Whether safe mode is on."""
        return self.safe_since is not None

    def gate(self, now: float, config: SchedulerConfig) -> HoldReason | None:
        """Why no move may start at ``now``, or None if one may."""
        if self.safe:
            return SafeMode(why=self.safe_reason)
        if self.in_flight is not None:
            return MoveInFlight(decision_id=self.in_flight)
        wait = self.last_move_end + config.min_move_interval_s - now
        if wait > 0:
            return MinimumInterval(wait_s=wait)
        return None

    def liveness_exempt(self, gate: HoldReason | None) -> bool:
        """Whether a round held by ``gate`` may still give a starved component a device
        (:func:`unblock`): safe mode the scheduler entered on its own holds the allocation
        for the job's sake, never so that it cannot finish (its cool-down is minutes). An
        operator's hold, a move in flight and the minimum interval (seconds; a starved
        component waits it out) are kept."""
        return isinstance(gate, SafeMode) and not self.operator_hold

    def started(self, decision_id: str) -> Safety:
        """A move was handed to the executor."""
        return replace(self, in_flight=decision_id)

    def moved_externally(self, now: float) -> Safety:
        """The pipeline moved devices on its own: the minimum interval counts from ``now``."""
        return replace(self, last_move_end=max(self.last_move_end, now))

    def finished(self, ok: bool, now: float, config: SchedulerConfig) -> Safety:
        """The move in flight ended; failures may start safe mode."""
        failures = 0 if ok else self.failures + 1
        after = replace(self, in_flight=None, failures=failures, last_move_end=now)
        if failures >= config.max_failed_moves and not after.safe:
            return after.enter(f"{failures} consecutive failed moves", now)
        return after

    def check_errors(
        self, errors: Mapping[str, tuple[float, int]], now: float, config: SchedulerConfig
    ) -> Safety:
        """Enter safe mode if a component's prediction error is beyond the bound."""
        if self.safe:
            return self
        for name, (error, count) in sorted(errors.items()):
            if count >= config.num_error_samples and error > config.max_prediction_error:
                return self.enter(
                    f"prediction error of {name} is {error:.2f} > {config.max_prediction_error}",
                    now,
                )
        return self

    def enter(self, reason: str, now: float, *, operator: bool = False) -> Safety:
        """Start safe mode (a no-op when already in it, unless an operator takes over)."""
        if self.safe and not operator:
            return self
        return replace(self, safe_since=now, safe_reason=reason, operator_hold=operator)

    def tick(self, now: float, config: SchedulerConfig) -> Safety:
        """End safe mode once its cool-down has passed (not an operator's hold)."""
        if self.safe_since is None or self.operator_hold:
            return self
        if now - self.safe_since >= config.safe_mode_cooldown_s:
            return self.leave()
        return self

    def leave(self) -> Safety:
        """End safe mode; the failure count starts over."""
        return replace(self, safe_since=None, safe_reason="", operator_hold=False, failures=0)
