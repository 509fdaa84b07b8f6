"""Stage 2: candidate reallocations, their predicted pipeline throughput, the commit rule.

The pipeline's rate is min over components of f_c(n_c) / W_c (iteration fraction per
second; f_c from the predictor, W_c the component's remaining items), and its remaining
time is the reciprocal. A candidate aims at a *level* t of that rate: every receiver
takes the smallest valid size whose predicted rate reaches t, the donor keeps the
largest valid size that still reaches t and frees what the receivers need (free devices
are used first; its ladder always holds the size that frees exactly that, so a thinned
ladder does not free devices no receiver takes), and whatever is left over stays free. A
donor with items of the iteration left, or whose predecessors have some, keeps at least
one replica (its work is not done, or its inputs keep coming).
Levels are the distinct rates the components reach at their valid sizes; when there
are at most ``num_candidates`` of them above the current rate every one is evaluated (the
search is then exhaustive: with a migration cost that does not decrease as more devices
and components move, no other reallocation of the donor's devices does better),
otherwise ``num_candidates`` levels spread up to the highest are. The best candidate
commits only when it saves strictly more than ``min_gain_s`` after charging its predicted
migration cost. Candidates are ranked by predicted finish (remaining time plus migration
cost); when the current allocation cannot finish (a component with items left holds no
device) every candidate that can has an unbounded gain and commits, the earliest finish
first. A component with no device and nothing queued is never limiting (its remaining
work is zero), so it is no reason to move while its predecessors still work.

Work per round is O(components × size points + candidates × components), independent of
the GPU count. Pure: everything comes in as one :class:`~dynarl.sched._decision.RoundInput`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dynarl.bus import NoFeasibleReduction, NoMovableDonor
from dynarl.sched._decision import Candidate, MigrationCost, Resize, RoundInput
from dynarl.sched._graph import HyperNode
from dynarl.sched._predictor import ThroughputPredictor
from dynarl.sched._sched_config import SchedulerConfig
from dynarl.sched._window import ComponentStats
from dynarl.types import MigrationKind

__all__ = ["Evaluation", "assess", "evaluate"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    """Stage 2's ranked candidates (best first) and the current allocation's numbers."""

    current: Candidate
    candidates: tuple[Candidate, ...]
    num_levels: int
    exhaustive: bool
    note: NoMovableDonor | NoFeasibleReduction | None = None
    """Why there are no candidates, when there are none."""


@dataclass(slots=True)
class _Context:
    nodes: Mapping[str, HyperNode]
    counts: dict[str, int]
    num_free: int
    stats: Mapping[str, ComponentStats]
    predictor: ThroughputPredictor
    config: SchedulerConfig
    total: int
    truncated: bool = False

    def rate(self, name: str, sizes: IntArray) -> FloatArray:
        stats = self.stats[name]
        if stats.remaining <= 0:
            return np.full(sizes.shape, math.inf)
        f = self.predictor.predict(name, sizes.astype(np.float64), stats.latest)
        return np.asarray(f, dtype=np.float64) / float(stats.remaining)

    def throughput(self, name: str, size: int) -> float:
        state = self.stats[name].latest
        return float(self.predictor.predict(name, np.array([float(size)]), state)[0])

    def ladder(self, name: str, low: int, high: int, extra: Iterable[int] = ()) -> IntArray:
        """Valid sizes of ``name`` in [low, high] (spread out), its size now and the valid
        ``extra`` ones in range, minus changes that are not whole TP groups or overflow a
        device's memory."""
        node, now = self.nodes[name], self.counts[name]
        if node.num_valid_sizes(low, high) > self.config.num_size_points:
            self.truncated = True
        more = {n for n in extra if low <= n <= high and node.is_valid_size(n)}
        sizes: IntArray = np.array(
            sorted({now, *more, *node.valid_sizes(low, high, self.config.num_size_points)}),
            dtype=np.int64,
        )
        # A change must be whole TP groups (only bites when the current size is off-grid).
        sizes = sizes[(sizes - now) % node.tp == 0]
        if node.state_bytes and node.migration is MigrationKind.P2P:
            dp = np.maximum(sizes // node.unit, 1)
            share = (1.0 - node.sharded_state_fraction) + node.sharded_state_fraction / dp
            per = np.where(sizes > 0, node.state_bytes / node.unit * share, 0.0)
            peak = np.where(
                (sizes != now) & (sizes > 0) & (now > 0), per + node.bytes_per_device(now), per
            )
            sizes = sizes[(peak <= self.config.device_memory_bytes) | (sizes == now)]
        return sizes


def evaluate(inputs: RoundInput) -> Evaluation:
    """Rank the candidate reallocations of the round's donors' devices (and the free ones).

    Only interruptible components with a report and a non-zero prediction, which the
    loss rule does not hold, take part; the others keep their size. Calls
    ``inputs.cost.estimate`` once per candidate.
    """
    ctx, known = _setup(inputs)
    current = _candidate(ctx, None, dict(ctx.counts), known, ctx.num_free)
    nodes, stats = inputs.nodes, inputs.stats
    movable = {
        n
        for n in known
        if nodes[n].interruptible and stats[n].interruptible and n not in inputs.held
    }
    donor_list = [d.component for d in inputs.donors if d.component in movable]
    if ctx.num_free and not donor_list:
        donor_list = [""]
    if not donor_list:
        return Evaluation(
            current=current, candidates=(), num_levels=0, exhaustive=True, note=NoMovableDonor()
        )
    config = inputs.config
    budget = max(3, config.num_candidates // len(donor_list))
    found: dict[tuple[tuple[str, int], ...], Candidate] = {}
    num_levels, exhaustive = 0, True
    for donor in donor_list:
        if len(found) >= config.num_candidates:
            exhaustive = False
            break
        limit = min(budget, config.num_candidates - len(found))
        levels, sizes = _levels(ctx, donor or None, movable - set(donor_list), known, current)
        num_levels += len(levels)
        exhaustive &= len(levels) <= limit
        picked = [sizes[index] for index in _pick(len(levels), limit)]
        for cand in _candidates(ctx, donor or None, picked, known):
            found.setdefault(cand.sizes, _charge(cand, current, ctx, inputs.cost))
    exhaustive &= not ctx.truncated
    ranked = sorted(found.values(), key=lambda c: _rank(c, ctx.counts))
    return Evaluation(
        current=current,
        candidates=tuple(ranked),
        num_levels=num_levels,
        exhaustive=exhaustive,
        note=None if ranked else NoFeasibleReduction(),
    )


def assess(inputs: RoundInput) -> Candidate:
    """The predicted numbers of the round's allocation as it is."""
    ctx, known = _setup(inputs)
    return _candidate(ctx, None, dict(ctx.counts), known, ctx.num_free)


def _setup(inputs: RoundInput) -> tuple[_Context, set[str]]:
    nodes, stats, counts = inputs.nodes, inputs.stats, inputs.counts()
    num_free = len(inputs.free)
    ctx = _Context(
        nodes=nodes,
        counts=counts,
        num_free=num_free,
        stats=stats,
        predictor=inputs.predictor,
        config=inputs.config,
        total=sum(counts.values()) + num_free,
    )
    # A component with nothing left is never limiting; otherwise a zero prediction at a
    # usable size means the predictor knows nothing about it, and it is left alone.
    known = {
        name
        for name in ctx.counts
        if name in stats
        and (
            stats[name].remaining <= 0
            or ctx.throughput(name, max(ctx.counts[name], nodes[name].unit)) > 0
        )
    }
    return ctx, known


def _levels(
    ctx: _Context,
    donor: str | None,
    receivers: set[str],
    known: set[str],
    current: Candidate,
) -> tuple[list[float], list[dict[str, int]]]:
    """Feasible target levels above the current rate, and the sizes reaching each."""
    counts = ctx.counts
    if donor is not None:
        d_sizes = ctx.ladder(donor, _floor(ctx, donor), counts[donor])
        d_rates = ctx.rate(donor, d_sizes)
        release = counts[donor] - int(d_sizes.min())
    else:
        d_sizes, d_rates, release = np.zeros(0, dtype=np.int64), np.zeros(0), 0
    grow = sorted(r for r in receivers if r != donor)
    ladders = {}
    for r in grow:
        high = min(ctx.nodes[r].upper_bound(ctx.total), counts[r] + release + ctx.num_free)
        sizes = ctx.ladder(r, counts[r], high)
        sizes = sizes[sizes >= counts[r]]
        ladders[r] = (sizes, np.maximum.accumulate(ctx.rate(r, sizes)))
    fixed = [n for n in known if n != donor and n not in ladders]
    ceiling = min((float(ctx.rate(n, np.array([counts[n]]))[0]) for n in fixed), default=math.inf)
    pool = [d_rates, np.array([ceiling])] + [best for _, best in ladders.values()]
    candidates = np.unique(np.concatenate(pool)) if pool else np.zeros(0)
    candidates = candidates[np.isfinite(candidates) & (candidates > current.pipeline_rate)]
    candidates = candidates[candidates <= ceiling]
    return _reach_all(ctx, candidates, donor, d_sizes, d_rates, ladders)


def _floor(ctx: _Context, name: str) -> int:
    """Fewest devices ``name`` may keep as a donor: one replica while work is left or comes.

    A component whose predecessors have items of the iteration left will receive more
    work; releasing its last replica would stall that work until another move (and
    another Stage 1 window) brings devices back, so it keeps one replica until its
    inputs are done, and so does one with items of its own left. Otherwise (its
    iteration's work done) it may go down to zero, when its minimum allows or it parks.
    """
    node = ctx.nodes[name]
    if ctx.counts[name] <= 0:
        return 0
    upstream = any(p in ctx.stats and ctx.stats[p].remaining > 0 for p in node.predecessors)
    working = upstream or ctx.stats[name].remaining > 0
    return max(node.min_devices, node.unit) if working else 0


def _reach_all(
    ctx: _Context,
    levels: FloatArray,
    donor: str | None,
    d_sizes: IntArray,
    d_rates: FloatArray,
    ladders: dict[str, tuple[IntArray, FloatArray]],
) -> tuple[list[float], list[dict[str, int]]]:
    """For every level at once: the sizes reaching it with the fewest devices moved.

    Each receiver takes its smallest size whose best rate reaches the level; the donor
    keeps its largest size that still reaches it and frees what the receivers need.
    Levels no allocation reaches are dropped, and so are levels whose allocation a lower
    level already reaches (ascending order is kept).
    """
    counts = ctx.counts
    need = np.full(levels.shape[0], -ctx.num_free, dtype=np.int64)
    feasible = np.ones(levels.shape[0], dtype=bool)
    columns: dict[str, IntArray] = {}
    for name, (sizes, best) in ladders.items():
        index = np.searchsorted(best, levels, side="left")
        feasible &= index < sizes.shape[0]
        columns[name] = sizes[np.minimum(index, sizes.shape[0] - 1)]
        need += columns[name] - counts[name]
    if donor is None:
        feasible &= need <= 0
    else:
        limit = counts[donor] - np.maximum(need, 0)
        d_sizes, d_rates = _exact(ctx, donor, d_sizes, d_rates, limit)
        ok = (d_sizes[None, :] <= limit[:, None]) & (d_rates[None, :] >= levels[:, None])
        feasible &= ok.any(axis=1)
        columns[donor] = np.where(ok, d_sizes[None, :], -1).max(axis=1)
    if not columns or not feasible.any():
        return [], []
    names = sorted(columns)
    table = np.stack([columns[n] for n in names], axis=1)[feasible]
    kept_levels = levels[feasible]
    _, first = np.unique(table, axis=0, return_index=True)
    first.sort()
    plans = []
    for row in table[first].tolist():
        plan = dict(counts)
        plan.update(zip(names, row, strict=True))
        plans.append(plan)
    return kept_levels[first].tolist(), plans


def _exact(
    ctx: _Context, donor: str, d_sizes: IntArray, d_rates: FloatArray, limit: IntArray
) -> tuple[IntArray, FloatArray]:
    """The donor's ladder plus, for every level, the largest whole-unit size within what
    the receivers leave it, so a donor never frees devices no receiver takes merely
    because its spread-out ladder skips the size it should keep."""
    if d_sizes.shape[0] == 0:
        return d_sizes, d_rates
    unit = ctx.nodes[donor].unit
    wanted = set((np.unique(limit) // unit * unit).tolist()) - set(d_sizes.tolist())
    if not wanted:
        return d_sizes, d_rates
    sizes = ctx.ladder(donor, _floor(ctx, donor), ctx.counts[donor], extra=wanted)
    return sizes, ctx.rate(donor, sizes)


def _free_after(ctx: _Context, sizes: Mapping[str, int]) -> int:
    return ctx.total - sum(sizes.values())


def _candidate(
    ctx: _Context, donor: str | None, sizes: dict[str, int], known: set[str], num_free: int
) -> Candidate:
    return _candidates(ctx, donor, [sizes], known)[0]


def _candidates(
    ctx: _Context, donor: str | None, plans: list[dict[str, int]], known: set[str]
) -> list[Candidate]:
    """Predicted numbers of each plan (one predictor call per component for all plans)."""
    names = sorted(known)
    throughput: dict[str, FloatArray] = {}
    rates: dict[str, FloatArray] = {}
    for name in names:
        sizes = np.array([plan[name] for plan in plans], dtype=np.float64)
        stats = ctx.stats[name]
        f = np.asarray(ctx.predictor.predict(name, sizes, stats.latest), dtype=np.float64)
        throughput[name] = f
        rates[name] = f / stats.remaining if stats.remaining > 0 else np.full(f.shape, math.inf)
    out = []
    for i, plan in enumerate(plans):
        row = {name: float(rates[name][i]) for name in names}
        bottleneck = min(row, key=lambda n: (row[n], n)) if row else None
        rate = row[bottleneck] if bottleneck is not None else math.inf
        out.append(
            Candidate(
                donor=donor,
                sizes=tuple(sorted(plan.items())),
                throughput=tuple((name, float(throughput[name][i])) for name in names),
                pipeline_rate=rate,
                remaining_s=0.0 if math.isinf(rate) else (math.inf if rate <= 0 else 1.0 / rate),
                bottleneck=bottleneck if bottleneck is not None and math.isfinite(rate) else None,
                num_free=_free_after(ctx, plan),
            )
        )
    return out


def _charge(cand: Candidate, current: Candidate, ctx: _Context, cost: MigrationCost) -> Candidate:
    resizes = tuple(
        Resize(
            component=name,
            migration=ctx.nodes[name].migration,
            old_devices=ctx.counts[name],
            new_devices=n,
            tp=ctx.nodes[name].tp,
            pp=ctx.nodes[name].pp,
            state_bytes=ctx.nodes[name].state_bytes,
        )
        for name, n in cand.sizes
        if n != ctx.counts[name]
    )
    estimate = cost.estimate(resizes)
    # A current allocation that cannot finish (a component with work holds nothing) is
    # left by any candidate that can: that gain is unbounded. Candidates are still ranked
    # against each other by their finite finish time (see ``_rank``), never by that gain.
    gain = current.remaining_s - (cand.remaining_s + estimate.seconds)
    if math.isinf(current.remaining_s) and math.isfinite(cand.remaining_s):
        gain = math.inf
    return Candidate(
        donor=cand.donor,
        sizes=cand.sizes,
        throughput=cand.throughput,
        pipeline_rate=cand.pipeline_rate,
        remaining_s=cand.remaining_s,
        bottleneck=cand.bottleneck,
        num_free=cand.num_free,
        cost_s=estimate.seconds,
        cost_bytes=estimate.bytes,
        gain_s=gain if not math.isnan(gain) else -math.inf,
    )


def _rank(
    cand: Candidate, counts: Mapping[str, int]
) -> tuple[float, float, int, tuple[tuple[str, int], ...]]:
    """Earliest predicted finish (remaining time plus migration cost) first.

    With a finite current remaining time this is the order of decreasing gain; when the
    current allocation cannot finish, every finite candidate's gain is unbounded and the
    finish time still tells them apart. Ties: higher rate, fewer devices moved, sizes.
    """
    moved = sum(abs(n - counts[name]) for name, n in cand.sizes)
    finish = cand.remaining_s + cand.cost_s if cand.gain_s > -math.inf else math.inf
    return (finish, -cand.pipeline_rate, moved, cand.sizes)


def _pick(count: int, limit: int) -> list[int]:
    """``limit`` indices of ``count`` levels: all, or spread out, always with the highest."""
    if count <= limit:
        return list(range(count))
    if limit <= 1:
        return [count - 1]
    step = (count - 1) / (limit - 1)
    return sorted({round(i * step) for i in range(limit)} | {count - 1})
