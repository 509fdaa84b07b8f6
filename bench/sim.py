"""Simulator speed: one iteration at 128 GPUs, one at 100,000 GPUs, vector-model agreement.

- ``sim_s_128``: wall seconds to simulate one iteration of ``math-1.5b-128gpu`` under
  ``dynarl`` (the real scheduler in the loop) with the per-request rollout model (median of
  three runs).
- ``sim_s_100k``: the same workload scaled to 100,000 GPUs with a constant number of
  requests per engine (the batch grows with the cluster), one iteration under ``dynarl``
  on the vectorised per-engine model; dynarl starts from its iteration-start allocation
  (:func:`~dynarl.sim.start_partition`) at either scale.
- ``vector_vs_request_error``: the largest relative throughput difference between the
  vector and the per-request models over the 128-GPU math workloads (1.5B, 7B, 32B) and
  the policies static-sequential, static-split, rlinf-rule and dynarl.

Targets: sim_s_128 < 1 s, sim_s_100k < 60 s, vector_vs_request_error <= 0.02. Times are
noisy on a shared machine; the agreement is deterministic. Last line: JSON.

Run: .venv/bin/python bench/sim.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path

from dynarl.sim import DynarlPolicy, Simulation, load_workload, run_policy
from dynarl.sim._vector import VectorRollout
from dynarl.sim._workload_file import Workload

ROOT = Path(__file__).resolve().parent.parent / "examples" / "workloads"
AGREEMENT = ("math-1.5b-128gpu", "math-7b-128gpu", "math-32b-128gpu")
POLICIES = ("static-sequential", "static-split", "rlinf-rule", "dynarl")


def one_iteration(workload: Workload) -> Workload:
    return replace(workload, num_iterations=1, num_warmup_iterations=0)


def scaled(workload: Workload, num_gpus: int) -> Workload:
    factor = num_gpus // workload.cluster.num_gpus
    batch = replace(workload.batch, num_prompts=workload.batch.num_prompts * factor)
    cluster = replace(workload.cluster, num_gpus=num_gpus)
    return replace(workload, cluster=cluster, batch=batch, name=f"{workload.name}-x{factor}")


def time_128(workload: Workload, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        policy = DynarlPolicy()
        sim = Simulation(workload, request_policy=policy.request_policy)
        start = time.perf_counter()
        sim.run(policy)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_100k(base: Workload, num_gpus: int) -> tuple[float, float]:
    workload = one_iteration(scaled(base, num_gpus))
    policy = DynarlPolicy()
    sim = Simulation(workload, request_policy=policy.request_policy, rollout_factory=VectorRollout)
    start = time.perf_counter()
    result = sim.run(policy)
    return time.perf_counter() - start, result.iteration_s


def agreement() -> tuple[float, list[dict[str, object]]]:
    rows = []
    worst = 0.0
    for name in AGREEMENT:
        workload = load_workload(ROOT / f"{name}.toml")
        for policy in POLICIES:
            request = run_policy(workload, policy).throughput
            vector = run_policy(workload, policy, vector=True).throughput
            error = abs(vector - request) / request
            worst = max(worst, error)
            rows.append({"workload": name, "policy": policy, "error": round(error, 5)})
    return worst, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the agreement sweep")
    parser.add_argument("--gpus", type=int, default=100_000, help="GPUs of the scaled run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    base = load_workload(ROOT / "math-1.5b-128gpu.toml")
    sim_128 = time_128(one_iteration(base), repeats=3)
    print(f"sim_s_128 = {sim_128:.3f} s (median of 3)", flush=True)
    sim_big, iteration = time_100k(base, args.gpus)
    print(f"sim_s_100k = {sim_big:.1f} s ({args.gpus} GPUs, iteration {iteration:.1f} s)")
    error, rows = (float("nan"), []) if args.quick else agreement()
    for row in rows:
        print(f"  {row['workload']:18s} {row['policy']:18s} error {row['error']:.4f}")
    print(
        json.dumps(
            {
                "sim_s_128": round(sim_128, 4),
                "sim_s_100k": round(sim_big, 2),
                "vector_vs_request_error": round(error, 5),
                "num_gpus_scaled": args.gpus,
            }
        )
    )


if __name__ == "__main__":
    main()
