"""One decision round's Stage 2 as a pure function: evaluate, apply the commit rule, place.

:func:`decide` ranks the candidates (see :mod:`dynarl.sched.candidates`), takes the best
one that saves strictly more than ``min_gain_s`` after its migration cost and whose TP
groups can stay node-local, and turns it into concrete device moves. :func:`hold` is the
round's record when the scheduler does not get as far as Stage 2 (no donor, safe mode,
minimum interval, a move in flight). Runs in the scheduler's loop or the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from dynarl.errors import SchedulingError
from dynarl.sched.candidates import assess, evaluate
from dynarl.sched.config import SchedulerConfig
from dynarl.sched.decision import Candidate, Decision, DeviceMove, MigrationCost, Rejection
from dynarl.sched.graph import HyperNode
from dynarl.sched.placement import place
from dynarl.sched.predictor import ThroughputPredictor
from dynarl.sched.window import ComponentStats, DonorSignal
from dynarl.types import Allocation

__all__ = ["decide", "hold"]


def decide(
    *,
    nodes: Mapping[str, HyperNode],
    allocation: Allocation,
    free: Sequence[int],
    stats: Mapping[str, ComponentStats],
    donors: Sequence[DonorSignal],
    predictor: ThroughputPredictor,
    cost: MigrationCost,
    config: SchedulerConfig,
    time: float,
) -> Decision:
    """Stage 2 over ``donors`` (and any free devices): the round's :class:`Decision`."""
    counts = {name: allocation.count(name) for name in nodes}
    evaluation = evaluate(
        nodes=nodes,
        counts=counts,
        num_free=len(free),
        stats=stats,
        donors=[d.component for d in donors],
        predictor=predictor,
        cost=cost,
        config=config,
    )
    chosen: Candidate | None = None
    moves: tuple[DeviceMove, ...] = ()
    rejected: list[Rejection] = []
    for cand in evaluation.candidates:
        if chosen is not None:
            reason = f"saves {cand.gain_s:.3f} s, less than the chosen {chosen.gain_s:.3f} s"
        elif not cand.gain_s > config.min_gain_s:
            reason = (
                f"not better after cost: saves {cand.gain_s:.3f} s net of "
                f"{cand.cost_s:.3f} s migration, needs more than {config.min_gain_s} s"
            )
        else:
            try:
                moves = place(
                    allocation, free, dict(cand.sizes), nodes, config.num_devices_per_node
                )
            except SchedulingError as err:
                reason = f"infeasible placement: {err}"
            else:
                chosen = cand
                continue
        rejected.append(Rejection(candidate=cand, reason=reason))
    if chosen is not None:
        gain = "all remaining work" if math.isinf(chosen.gain_s) else f"{chosen.gain_s:.3f} s"
        reason = (
            f"commit: saves {gain} net of {chosen.cost_s:.3f} s migration; "
            f"bottleneck {chosen.bottleneck}"
        )
    elif rejected:
        reason = f"rejected: {rejected[0].reason}"
    else:
        reason = f"rejected: {evaluation.note}"
    return Decision(
        time=time,
        committed=chosen is not None,
        reason=reason,
        old_allocation=allocation,
        current=evaluation.current,
        chosen=chosen,
        moves=moves,
        donors=tuple(d.component for d in donors),
        rejected=tuple(rejected),
        num_levels=evaluation.num_levels,
        exhaustive=evaluation.exhaustive,
    )


def hold(
    *,
    reason: str,
    nodes: Mapping[str, HyperNode],
    allocation: Allocation,
    free: Sequence[int],
    stats: Mapping[str, ComponentStats],
    predictor: ThroughputPredictor,
    config: SchedulerConfig,
    time: float,
    donors: Sequence[DonorSignal] = (),
) -> Decision:
    """A round that commits nothing for ``reason``, with the current predicted numbers."""
    current = assess(
        nodes=nodes,
        counts={name: allocation.count(name) for name in nodes},
        num_free=len(free),
        stats=stats,
        predictor=predictor,
        config=config,
    )
    return Decision(
        time=time,
        committed=False,
        reason=reason,
        old_allocation=allocation,
        current=current,
        donors=tuple(d.component for d in donors),
    )
