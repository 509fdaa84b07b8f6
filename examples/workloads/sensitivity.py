"""Why does dynarl gain what it gains on a math workload? Counterfactuals and a breakdown.

For a shipped math workload this script runs ``static-sequential`` and ``dynarl`` on the
file as it is and on counterfactual copies that each change one modelling choice, and
prints dynarl's speedup for each:

- ``kv x0.5`` / ``kv x0``: decode reads the KV cache at twice the bandwidth / for free
  (the tail's long contexts no longer slow an engine they are merged onto);
- ``gemm hidden``: a decode step's GEMM compute hides under its weight reads (roofline
  ``max`` instead of the file's sum; an upper bound on that correction);
- ``kv uncapped``: the engines' KV capacity is SGLang's memory fraction, not F8's 100 GB;
- ``downstream x0.5`` / ``x1.5``: log-prob inference and training at half / 1.5 times the
  speed of assumption A8.

Speedups compare mean measured iteration times (the same tokens per iteration). Then, for
the file as it is, the breakdown of the first measured iteration under each policy: when
rollout, inference and each mini-batch finish, and the GPU-seconds each component held.
Nothing here is a calibration input; docs/calibration.md ("Validation") quotes its output.

Run: .venv/bin/python examples/workloads/sensitivity.py examples/workloads/math-7b-64gpu.toml
(about a minute). Last line: JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

from dynarl.sched import FifoPolicy
from dynarl.sim import DynarlPolicy, Simulation, Workload, load_workload
from dynarl.sim.policies import make_policy

GIB = 1 << 30


def variants(w: Workload) -> dict[str, Workload]:
    """The file and its one-change counterfactuals."""
    ro = w.rollout

    def downstream(factor: float) -> Workload:
        return replace(
            w,
            inference=replace(
                w.inference, tokens_per_s_per_gpu=w.inference.tokens_per_s_per_gpu * factor
            ),
            trainer=replace(
                w.trainer, tokens_per_s_per_gpu=w.trainer.tokens_per_s_per_gpu * factor
            ),
        )

    weights = 2.0 * w.model.num_params
    memory = ro.tp * w.cluster.gpu_memory_gib * GIB * 0.85 - weights
    uncapped = max(1.0, memory // w.model.kv_bytes_per_token / ro.kv_capacity_tokens)
    return {
        "as shipped": w,
        "kv x0.5": replace(w, rollout=replace(ro, step_per_kv_token_s=ro.step_per_kv_token_s / 2)),
        "kv x0": replace(w, rollout=replace(ro, step_per_kv_token_s=0.0)),
        "gemm hidden": replace(w, rollout=replace(ro, step_per_seq_s=0.0)),
        "kv uncapped": replace(
            w,
            rollout=replace(
                ro,
                kv_capacity_tokens=int(ro.kv_capacity_tokens * uncapped),
                max_running_requests=int(ro.max_running_requests * uncapped),
            ),
        ),
        "downstream x0.5": downstream(0.5),
        "downstream x1.5": downstream(1.5),
    }


def breakdown(w: Workload, name: str) -> dict[str, float]:
    """One measured iteration of ``name`` on ``w``: event times and GPU-seconds held."""
    policy = make_policy(name)
    events: dict[str, float] = {}
    inner = policy.on_event

    def on_event(sim: Simulation, event: str, iteration: int, index: int = 0) -> None:
        if iteration == w.num_warmup_iterations:
            events.setdefault(f"{event}_{index}" if event == "minibatch" else event, sim.loop.now)
        inner(sim, event, iteration, index)

    policy.on_event = on_event  # type: ignore[method-assign]
    request = policy.request_policy if isinstance(policy, DynarlPolicy) else FifoPolicy
    result = Simulation(w, request_policy=request).run(policy)
    it = next(i for i in result.iterations if i.index == w.num_warmup_iterations)
    tl = result.timeline
    held = dict.fromkeys(tl.components, 0.0)
    rows = [*zip(tl.times, tl.counts, strict=True), (it.end, tl.counts[-1])]
    for (t0, counts), (t1, _) in itertools.pairwise(rows):
        span = min(t1, it.end) - max(t0, it.start)
        if span > 0:
            for component, count in zip(tl.components, counts, strict=True):
                held[component] += count * span
    out = {"mean_iteration_s": result.iteration_s, "iteration_s": it.seconds}
    out |= {f"{e}_s": t - it.start for e, t in events.items() if e != "iteration_start"}
    out |= {f"{c}_gpu_s": v for c, v in held.items()}
    return {k: round(v, 1) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", type=Path)
    args = parser.parse_args(argv)
    w = load_workload(args.workload)
    if w.agentic is not None:
        print("math workloads only", file=sys.stderr)
        return 2
    speedups: dict[str, float] = {}
    parts: dict[str, dict[str, float]] = {}
    for label, variant in variants(w).items():
        runs = {name: breakdown(variant, name) for name in ("static-sequential", "dynarl")}
        static, dynamic = (runs[n]["mean_iteration_s"] for n in runs)
        speedups[label] = round(static / dynamic, 3)
        print(
            f"{label:16s} static-sequential {static:6.1f} s  dynarl {dynamic:6.1f} s  "
            f"x{static / dynamic:.3f}",
            flush=True,
        )
        if label == "as shipped":
            parts = runs
    for name, part in parts.items():
        print(name, part)
    print(json.dumps({"workload": w.name, "speedups": speedups, "breakdown": parts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
