"""How much can any dynamic policy gain on a workload? A lower bound on its iteration time.

A dynamic policy overlaps inference and training with rollout's tail by taking rollout
engines away as requests finish; the engines it takes abort their requests, which
re-prefill and decode on the rest, slower the more long contexts share an engine. For a
rollout *shrink schedule* (rollout devices over time) this script replays the rollout
alone, releasing the least-loaded engines as dynarl's placement does, and measures when
its last sample finishes (F) and the GPU-seconds it held (G). Whatever a policy does
with the other devices, an iteration that follows that schedule lasts at least

    T >= max(F, (G + W) / N)

where W is the iteration's inference and training GPU-seconds and N the cluster size —
with free migrations and the downstream work packed perfectly into the devices rollout
does not hold. The script searches monotone schedules (a grid, then a seeded random
search) and prints the best T it finds next to static-sequential's iteration time: the
largest speedup over static-sequential any policy following such a schedule can reach.

Run: .venv/bin/python examples/workloads/overlap_bound.py examples/workloads/math-7b-64gpu.toml
[--samples 150] (a few minutes for 7B at 64 GPUs). Last line: JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from dynarl.sim import (
    Workload,
    build_trace,
    load_workload,
    rollout_alone,
    run_policy,
    start_partition,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Replay:
    """One shrink schedule replayed."""

    schedule: tuple[tuple[float, int], ...]
    finish_s: float
    gpu_s: float


def replay(workload: Workload, schedule: tuple[tuple[float, int], ...], iteration: int) -> Replay:
    """Rollout alone under ``schedule`` ((time, devices) steps, the first at time 0)."""
    w = workload
    loop, rollout = rollout_alone(w, schedule[0][1], iteration)
    held = [(0.0, schedule[0][1])]

    def shrink(target: int) -> None:
        engines = list(rollout.engines.values())
        count = (len(rollout.devices) - target) // w.rollout.tp
        if count <= 0:
            return
        for engine in engines:
            engine.advance(loop.now)
        lightest = sorted(engines, key=lambda e: (e.kv_tokens, e.index))[:count]
        rollout.remove_devices([d for e in lightest for d in e.devices])
        held.append((loop.now, len(rollout.devices)))

    for time, devices in schedule[1:]:
        loop.at(time, lambda devices=devices: shrink(devices))
    loop.run(until=1e7, max_events=100_000_000)
    finish = loop.now
    steps = [*held, (finish, 0)]
    gpu_s = sum(
        n * (min(t1, finish) - t0) for (t0, n), (t1, _) in itertools.pairwise(steps) if t0 < finish
    )
    return Replay(schedule=schedule, finish_s=finish, gpu_s=gpu_s)


def downstream_gpu_s(workload: Workload, iteration: int) -> float:
    """W: GPU-seconds of the iteration's log-prob inference and training."""
    tokens = float(build_trace(workload, iteration).total_tokens.sum())
    w = workload
    return tokens / w.inference.tokens_per_s_per_gpu + tokens / w.trainer.tokens_per_s_per_gpu


def schedules(
    start: int, unit: int, samples: int, seed: int
) -> list[tuple[tuple[float, int], ...]]:
    """The no-shrink schedule, a grid of 3-step ones, and ``samples`` random monotone ones."""
    sizes = sorted({max(unit, (start * k // 16) // unit * unit) for k in (1, 2, 4, 8, 12)})
    out: list[tuple[tuple[float, int], ...]] = [((0.0, start),)]
    for t1, t2, t3 in itertools.combinations((150.0, 200.0, 250.0, 300.0, 350.0, 400.0), 3):
        for r1, r2, r3 in itertools.combinations_with_replacement(sorted(sizes, reverse=True), 3):
            if r1 >= r2 >= r3 and r1 < start:
                out.append(((0.0, start), (t1, r1), (t2, r2), (t3, r3)))
    rng = random.Random(seed)
    pool = [s for s in range(unit, start, unit)]
    for _ in range(samples):
        k = rng.randint(2, 6)
        times = sorted(rng.uniform(100.0, 450.0) for _ in range(k))
        steps = sorted((rng.choice(pool) for _ in range(k)), reverse=True)
        out.append(((0.0, start), *zip(times, steps, strict=True)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", type=Path)
    parser.add_argument("--samples", type=int, default=150, help="random schedules")
    parser.add_argument("--grid", action="store_true", help="also the 3-step grid (slow)")
    parser.add_argument("--iteration", type=int, default=1, help="trace iteration")
    args = parser.parse_args(argv)
    w = load_workload(args.workload)
    if w.agentic is not None:
        print("the bound covers single-turn (math) workloads", file=sys.stderr)
        return 2
    base = run_policy(w, "static-sequential").iteration_s
    work = downstream_gpu_s(w, args.iteration)
    start = start_partition(w)["rollout"]
    found = schedules(start, w.rollout.tp, args.samples, seed=w.seed)
    if not args.grid:
        found = [found[0], *found[-args.samples :]]
    n = w.cluster.num_gpus
    best: tuple[float, Replay] | None = None
    for schedule in found:
        r = replay(w, schedule, args.iteration)
        bound = max(r.finish_s, (r.gpu_s + work) / n)
        if best is None or bound < best[0]:
            best = (bound, r)
            steps = ", ".join(f"{t:.0f}s:{d}" for t, d in schedule)
            print(f"T >= {bound:.1f} s (F {r.finish_s:.1f} s, G {r.gpu_s:.0f} GPU-s): {steps}")
    assert best is not None
    print(
        json.dumps(
            {
                "workload": w.name,
                "static_sequential_s": round(base, 1),
                "downstream_gpu_s": round(work, 1),
                "best_bound_s": round(best[0], 1),
                "max_speedup": round(base / best[0], 3),
                "schedules": len(found),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
