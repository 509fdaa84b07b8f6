"""Stage 2 against an exhaustive search under the same predictor and cost, and its invariants.

The exhaustive search tries every way of shrinking the donor to a valid size and growing
the other components to valid sizes with the devices it frees (plus the free ones),
scores each with the same predictor and the same migration cost, and keeps the best net
gain. The cost model is monotone (it never decreases when more devices or components
move), which is the condition under which the level search is exact.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hypothesis import event, given, note
from hypothesis import strategies as st
from sched_support import PowerLawPredictor, report, stats_of

from dynarl.sched import CostEstimate, HyperNode, Resize, SchedulerConfig
from dynarl.sched._decision import RoundInput
from dynarl.sched._planner import decide
from dynarl.sched._window import DonorSignal
from dynarl.types import Allocation, ComponentKind


@dataclass(frozen=True)
class MonotoneCost:
    fixed: float
    per_device: float
    per_component: float

    def estimate(self, resizes: tuple[Resize, ...]) -> CostEstimate:
        moving = [r for r in resizes if r.new_devices != r.old_devices]
        if not moving:
            return CostEstimate(seconds=0.0)
        moved = sum(abs(r.new_devices - r.old_devices) for r in moving)
        return CostEstimate(
            seconds=self.fixed + self.per_device * moved + self.per_component * len(moving)
        )


@st.composite
def components(draw: st.DrawFn, name: str) -> tuple[HyperNode, int]:
    tp = draw(st.sampled_from((1, 1, 2, 4)))
    dp_sizes = draw(st.sampled_from(((), (1, 2, 4), (1, 3))))
    min_devices = draw(st.sampled_from((0, tp, 2 * tp)))
    max_devices = draw(st.sampled_from((None, 4 * tp, 8)))
    if max_devices is not None and max_devices < max(min_devices, 1):
        max_devices = None
    node = HyperNode(
        name=name,
        kind=ComponentKind.ROLLOUT,
        tp=tp,
        dp_sizes=dp_sizes,
        min_devices=min_devices,
        max_devices=max_devices,
        parkable=draw(st.booleans()),
    )
    valid = [n for n in range(0, 9) if node.is_valid_size(n)]
    return node, draw(st.sampled_from(valid or [0]))


@st.composite
def instances(draw: st.DrawFn) -> dict[str, object]:
    num = draw(st.integers(2, 3))
    names = [f"c{i}" for i in range(num)]
    built = [draw(components(n)) for n in names]
    nodes = {node.name: node for node, _ in built}
    counts = {node.name: count for node, count in built}
    params = {
        n: (
            draw(st.floats(1.0, 50.0)),
            draw(st.floats(0.3, 1.0)),
            draw(st.sampled_from((0.0, 2.0, 4.0))),
        )
        for n in names
    }
    # The donor is usually over-provisioned (little work left), the others busy; the
    # per-device cost is often large enough that a lower level beats the highest.
    remaining = {n: draw(st.integers(0, 400)) for n in names}
    remaining["c0"] = draw(st.sampled_from((0, 1, 5, 20, 200)))
    cost = MonotoneCost(
        fixed=draw(st.floats(0.0, 1.0)),
        per_device=draw(st.sampled_from((0.0, 0.2, 1.0, 3.0))),
        per_component=draw(st.floats(0.0, 1.0)),
    )
    return {
        "nodes": nodes,
        "counts": counts,
        "params": params,
        "remaining": remaining,
        "num_free": draw(st.integers(0, 3)),
        "cost": cost,
        "min_gain": draw(st.sampled_from((0.0, 0.5))),
        "interruptible": {n: draw(st.booleans()) or n == "c0" for n in names},
    }


def remaining_time(
    sizes: dict[str, int], inst: dict[str, object], predictor: PowerLawPredictor
) -> float:
    worst = 0.0
    for name, n in sizes.items():
        w = inst["remaining"][name]  # type: ignore[index]
        if w <= 0:
            continue
        f = float(predictor.predict(name, [n], report(name, remaining=w))[0])  # type: ignore[arg-type]
        worst = max(worst, math.inf if f <= 0 else w / f)
    return worst


def exhaustive_best(inst: dict[str, object], predictor: PowerLawPredictor) -> tuple[float, float]:
    """The best gain of any reallocation, and the earliest finish (remaining time plus
    migration cost) of any that can finish."""
    nodes: dict[str, HyperNode] = inst["nodes"]  # type: ignore[assignment]
    counts: dict[str, int] = inst["counts"]  # type: ignore[assignment]
    interruptible: dict[str, bool] = inst["interruptible"]  # type: ignore[assignment]
    cost: MonotoneCost = inst["cost"]  # type: ignore[assignment]
    total = sum(counts.values()) + inst["num_free"]  # type: ignore[operator]
    before = remaining_time(counts, inst, predictor)
    options = {}
    for name, node in nodes.items():
        now = counts[name]
        if not interruptible[name]:
            options[name] = [now]
        elif name == "c0":
            options[name] = [now] + [s for s in range(0, now) if node.is_valid_size(s)]
        else:
            options[name] = [now] + [s for s in range(now + 1, total + 1) if node.is_valid_size(s)]
    best, finish = -math.inf, math.inf
    for combo in itertools.product(*options.values()):
        sizes = dict(zip(options, combo, strict=True))
        if sum(sizes.values()) > total or sizes == counts:
            continue
        resizes = tuple(
            Resize(component=n, migration=nodes[n].migration, old_devices=counts[n], new_devices=s)
            for n, s in sizes.items()
            if s != counts[n]
        )
        after = remaining_time(sizes, inst, predictor) + cost.estimate(resizes).seconds
        gain = math.inf if math.isinf(before) and math.isfinite(after) else before - after
        best = max(best, gain)
        finish = min(finish, after)
    return best, finish


@given(instances())
def test_stage2_matches_exhaustive_search_and_keeps_constraints(inst: dict[str, object]) -> None:
    nodes: dict[str, HyperNode] = inst["nodes"]  # type: ignore[assignment]
    counts: dict[str, int] = inst["counts"]  # type: ignore[assignment]
    predictor = PowerLawPredictor(inst["params"])  # type: ignore[arg-type]
    start = 0
    mapping = {}
    for name in sorted(counts):
        mapping[name] = range(start, start + counts[name])
        start += counts[name]
    free = tuple(range(start, start + inst["num_free"]))  # type: ignore[operator]
    allocation = Allocation.of(mapping)
    stats = stats_of(
        *(
            report(
                n,
                remaining=inst["remaining"][n],  # type: ignore[index]
                interruptible=inst["interruptible"][n],  # type: ignore[index]
            )
            for n in counts
        )
    )
    config = SchedulerConfig(num_devices_per_node=64, min_gain_s=inst["min_gain"])  # type: ignore[arg-type]
    decision = decide(
        RoundInput(
            nodes=nodes,
            allocation=allocation,
            free=free,
            stats=stats,
            donors=(DonorSignal(component="c0", idle_fraction=1.0, mean_utilization=0.0),),
            predictor=predictor,
            cost=inst["cost"],  # type: ignore[arg-type]
            config=config,
            time=0.0,
        )
    )
    note(f"decision: {decision.reason}; exhaustive={decision.exhaustive}")
    total = allocation.total + len(free)
    for cand in [c for c in (decision.chosen,) if c] + [r.candidate for r in decision.rejected]:
        assert sum(n for _, n in cand.sizes) + cand.num_free == total
        for name, n in cand.sizes:
            assert n == counts[name] or nodes[name].is_valid_size(n), (name, n)
    if decision.committed:
        new = decision.new_allocation()
        assert dict(decision.chosen.sizes) == {n: new.count(n) for n in nodes}  # type: ignore[union-attr]
        moved_in = {d for m in decision.moves if m.dst for d in m.devices}
        assert moved_in <= set(free) | {d for m in decision.moves if m.src for d in m.devices}
    best, finish = exhaustive_best(inst, predictor)
    ours = decision.chosen.gain_s if decision.committed else -math.inf  # type: ignore[union-attr]
    if decision.exhaustive:
        if best > config.min_gain_s:
            assert decision.committed, (best, decision.reason)
            assert ours == best or math.isclose(ours, best, rel_tol=1e-9, abs_tol=1e-9)
        else:
            assert not decision.committed
        if decision.committed and math.isinf(decision.current.remaining_s):
            # A stalled pipeline: every way out gains "everything"; the earliest finish wins.
            event("stalled pipeline")
            chosen = decision.chosen
            assert chosen is not None
            assert math.isclose(chosen.remaining_s + chosen.cost_s, finish, rel_tol=1e-9)
    else:
        assert ours <= best + 1e-9
