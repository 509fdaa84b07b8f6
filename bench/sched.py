"""Latency of one whole decision round, for 7 components at 128 to 102,400 GPUs.

A round is what the controller side does per reporting interval: the group managers
fold one interval of per-worker metrics into one report per component (columnar
ingest + :meth:`MetricsBuffer.report`), Stage 1 folds the reports into its windows and
finds donors, and Stage 2 evaluates up to 10 candidates and places the committed one on
concrete devices. The job is in the rollout tail (rollout idle, trainer the bottleneck),
so every round commits and placement is included. Also reported: per-message ingest cost
(a manager's work as each WorkerMetrics arrives, spread over the interval), the cost of
building the command's full new Allocation, and the predictor estimators' median
relative error with 20% outliers (the measurement behind the default). Last line: JSON.

Figures are medians over repeated rounds (minimums also reported: the machine this is
developed on is shared, and the minimum shows the uncontended cost).

Run: .venv/bin/python bench/sched.py
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from dynarl.bus import ComponentReport, WorkerMetrics
from dynarl.sched import (
    ComponentProfile,
    HyperNode,
    MetricsBuffer,
    ProfilePoint,
    RegressionPredictor,
    SchedulerConfig,
    StaticMigrationCost,
)
from dynarl.sched._decision import RoundInput
from dynarl.sched._planner import decide
from dynarl.sched._sched_config import PredictorConfig
from dynarl.sched._window import WindowSet, detect_donors
from dynarl.types import Allocation, ComponentKind, MigrationKind

SCALES = (128, 1024, 10240, 102400)
# name: (kind, share of the GPUs, tp, migration, remaining items, busy?)
COMPONENTS = {
    "rollout": (ComponentKind.ROLLOUT, 0.40, 1, MigrationKind.WORKLOAD, 0.02, False),
    "actor_logprob": (ComponentKind.INFERENCE, 0.10, 1, MigrationKind.WORKLOAD, 1.0, True),
    "ref_logprob": (ComponentKind.INFERENCE, 0.10, 1, MigrationKind.WORKLOAD, 1.0, True),
    "reward": (ComponentKind.REWARD, 0.05, 1, MigrationKind.WORKLOAD, 1.0, True),
    "tool": (ComponentKind.TOOL, 0.05, 1, MigrationKind.WORKLOAD, 1.0, True),
    "critic": (ComponentKind.TRAINER, 0.10, 2, MigrationKind.P2P, 1.0, True),
    "trainer": (ComponentKind.TRAINER, 0.20, 4, MigrationKind.P2P, 3.0, True),
}
RATES = {"rollout": 400.0, "trainer": 8.0, "critic": 30.0}


def build(total: int) -> tuple[dict[str, HyperNode], Allocation, RegressionPredictor]:
    nodes, mapping = {}, {}
    names = list(COMPONENTS)
    counts = {
        name: max(tp, int(total * share) // tp * tp)
        for name, (_, share, tp, _, _, _) in COMPONENTS.items()
    }
    counts["rollout"] += total - sum(counts.values())  # rollout (TP 1) takes the rest
    start = 0
    for name, (kind, _, tp, migration, _, _) in COMPONENTS.items():
        nodes[name] = HyperNode(
            name=name, kind=kind, migration=migration, tp=tp, min_devices=tp, state_bytes=1 << 30
        )
        mapping[name] = range(start, start + counts[name])
        start += counts[name]
    profiles = {}
    for name in names:
        rate = RATES.get(name, 50.0)
        q = 64.0 if name == "rollout" else 0.0
        points = tuple(
            ProfilePoint(num_devices=n, throughput=rate * n**0.9) for n in (1, 2, 4, 8, 16, 64, 256)
        )
        profiles[name] = ComponentProfile(points=points, items_per_device=q)
    return nodes, Allocation.of(mapping), RegressionPredictor(profiles)


def interval_columns(count: int, busy: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    util = rng.uniform(0.6, 1.0, count) if busy else rng.uniform(0.0, 0.1, count)
    return {
        "workers": np.arange(count),
        "utilization": util,
        "queue_depth": rng.integers(0, 8, count),
        "completed": rng.integers(0, 4, count),
        "in_flight": rng.integers(0, 8, count),
    }


def one_round(
    buffers: dict[str, MetricsBuffer],
    columns: dict[str, dict[str, np.ndarray]],
    windows: WindowSet,
    now: float,
    ctx: tuple[dict[str, HyperNode], Allocation, RegressionPredictor, SchedulerConfig],
) -> tuple[float, float, float, int, bool]:
    nodes, allocation, predictor, config = ctx
    cost = StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 4.0, MigrationKind.P2P: 1.0})
    t0 = time.perf_counter()
    reports: list[ComponentReport] = []
    for name, buffer in buffers.items():
        cols = columns[name]
        buffer.add_columns(
            cols["workers"],
            cols["utilization"],
            queue_depth=cols["queue_depth"],
            completed=cols["completed"],
            in_flight=cols["in_flight"],
        )
        remaining = int(COMPONENTS[name][4] * allocation.count(name) * 100)
        reports.append(buffer.report(time=now, interval_s=1.0, remaining=max(remaining, 1)))
    t1 = time.perf_counter()
    for report in reports:
        windows.observe(report)
    stats = windows.stats()
    donors = detect_donors(stats, config)
    t2 = time.perf_counter()
    decision = decide(
        RoundInput(
            nodes=nodes,
            allocation=allocation,
            stats=stats,
            donors=tuple(donors),
            predictor=predictor,
            cost=cost,
            config=config,
            time=now,
        )
    )
    t3 = time.perf_counter()
    evaluated = len(decision.rejected) + (1 if decision.chosen else 0)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, evaluated, decision.committed


def bench_scale(total: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(total)
    nodes, allocation, predictor = build(total)
    config = SchedulerConfig(num_candidates=10)
    buffers = {n: MetricsBuffer(n, str(COMPONENTS[n][0]), allocation.count(n)) for n in nodes}
    columns = {n: interval_columns(allocation.count(n), COMPONENTS[n][5], rng) for n in nodes}
    windows = WindowSet(config)
    ctx = (nodes, allocation, predictor, config)
    now = 0.0
    for _ in range(5):  # warm the windows past T = 4 s so the rollout tail is a donor
        now += 1.0
        one_round(buffers, columns, windows, now, ctx)
    rows = []
    for _ in range(repeats):
        now += 1.0
        rows.append(one_round(buffers, columns, windows, now, ctx))
    total_ms = [a + b + c for a, b, c, _, _ in rows]
    return {
        "decision_ms": statistics.median(total_ms),
        "decision_min_ms": min(total_ms),
        "aggregate_ms": statistics.median(r[0] for r in rows),
        "stage1_ms": statistics.median(r[1] for r in rows),
        "stage2_ms": statistics.median(r[2] for r in rows),
        "candidates": float(max(r[3] for r in rows)),
        "committed": float(all(r[4] for r in rows)),
    }


def ingest_ns_per_message(count: int = 20000) -> float:
    buffer = MetricsBuffer("rollout", "rollout", count)
    messages = [
        WorkerMetrics(component="rollout", worker=w, time=1.0, interval_s=1.0, utilization=0.5)
        for w in range(count)
    ]
    start = time.perf_counter()
    for m in messages:
        buffer.add(m)
    return (time.perf_counter() - start) / count * 1e9


def command_ms(total: int) -> float:
    _, allocation, _ = build(total)
    moved = allocation.devices("rollout")[: total // 10]
    start = time.perf_counter()
    allocation.move(moved, "rollout", "trainer")
    return (time.perf_counter() - start) * 1e3


def predictor_errors(samples: int = 30, seeds: int = 20) -> dict[str, float]:
    def truth(n: float, r: float, a: float = 50.0) -> float:
        s = r / 16.0
        return a * (n * s / (n + s)) ** 0.8

    out = {}
    for estimator in ("theil_sen", "huber", "ols"):
        errors = []
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            profile = ComponentProfile(
                points=tuple(
                    ProfilePoint(num_devices=n, throughput=truth(n, 1e12, a=40.0))
                    for n in (1, 2, 4, 8, 16, 32)
                ),
                items_per_device=16.0,
            )
            pred = RegressionPredictor({"r": profile}, PredictorConfig(estimator=estimator))  # type: ignore[arg-type]
            for _ in range(samples):
                n, r = int(rng.choice([8, 16, 24, 32, 48, 64])), int(rng.integers(50, 5000))
                y = truth(n, r) * (1 + 0.05 * rng.standard_normal())
                if rng.random() < 0.2:
                    y *= float(rng.choice([rng.uniform(0.05, 0.5), rng.uniform(2.0, 10.0)]))
                state = ComponentReport(
                    component="r",
                    kind="rollout",
                    time=0.0,
                    interval_s=1.0,
                    utilization=(),
                    remaining=r,
                    throughput=y,
                )
                pred.observe("r", n, state)
                pred.refit()
            grid = [(n, r) for n in (4, 8, 16, 32, 64) for r in (100, 500, 1000, 4000)]
            rel = [
                abs(
                    float(
                        pred.predict(
                            "r",
                            np.array([float(n)]),
                            ComponentReport(
                                component="r",
                                kind="rollout",
                                time=0.0,
                                interval_s=1.0,
                                utilization=(),
                                remaining=r,
                            ),
                        )[0]
                    )
                    - truth(n, r)
                )
                / truth(n, r)
                for n, r in grid
            ]
            errors.append(statistics.median(rel))
        out[f"predictor_median_rel_err_{estimator}"] = statistics.median(errors)
        out[f"predictor_worst_seed_rel_err_{estimator}"] = max(errors)
    return out


def main() -> None:
    results = {}
    for total in SCALES:
        repeats = 40 if total <= 10240 else 20
        row = bench_scale(total, repeats)
        results[total] = row
        print(
            f"{total:>7} GPUs: round {row['decision_ms']:8.3f} ms median, "
            f"{row['decision_min_ms']:.3f} min "
            f"(aggregate {row['aggregate_ms']:.3f}, stage 1 {row['stage1_ms']:.3f}, "
            f"stage 2 {row['stage2_ms']:.3f}); candidates {row['candidates']:.0f}, "
            f"committed {bool(row['committed'])}"
        )
    extra = {
        "ingest_ns_per_message": ingest_ns_per_message(),
        "command_allocation_ms_100k": command_ms(102400),
    }
    extra |= predictor_errors()
    for key, value in extra.items():
        print(f"{key}: {value:.4g}")
    small, large = results[128]["decision_ms"], results[102400]["decision_ms"]
    summary = {
        "decision_ms_128": round(small, 4),
        "decision_ms_1024": round(results[1024]["decision_ms"], 4),
        "decision_ms_10240": round(results[10240]["decision_ms"], 4),
        "decision_ms_100k": round(large, 4),
        "ratio_100k_to_128": round(large / small, 3),
        "decision_min_ms_128": round(results[128]["decision_min_ms"], 4),
        "decision_min_ms_100k": round(results[102400]["decision_min_ms"], 4),
        "stage2_ms_100k": round(results[102400]["stage2_ms"], 4),
        "candidates_100k": results[102400]["candidates"],
    } | {k: round(v, 4) for k, v in extra.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
