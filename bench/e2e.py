"""dynarl against static schedules on the reference GRPO job (the demo's job), end to end.

Runs the job (two worker processes by default, deterministic mode, the same seed) under
static sequential, every static split and dynarl, one after the other on this machine,
then asks the simulator (``dynarl.sim``) to predict dynarl's iteration time for the same
setup, built from the phase times the static-sequential run measured. Prints a table and,
last, one JSON line:

- ``speedup_vs_static``: static-sequential wall time / dynarl wall time (target >= 1.15);
- ``speedup_vs_best_split``: best static split wall time / dynarl's (target >= 1.0);
- ``manifests_equal``: per-step sample ids, micro-batches and update order identical;
- ``sim_prediction_error``: |predicted - measured| / measured of dynarl's mean step time.

Wall times are measured on a shared machine: run it more than once and read the spread.

    .venv/bin/python bench/e2e.py [--steps N] [--devices N] [--task tool_calc|chain_sum]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from queue import Empty
from typing import Any

from dynarl.backends.reference.experiment import (
    Comparison,
    ExperimentConfig,
    RunResult,
    compare,
    plans,
    prepare_setup,
    profiles_from,
    run_plan,
)
from dynarl.sched import FifoPolicy
from dynarl.sim import DynarlPolicy, Simulation, workload_from_dict


async def _all_runs(config: ExperimentConfig, setup: Any, root: Path) -> Comparison:
    dynarl_plan, sequential_plan, split_plans = plans(config)
    sequential = await run_plan(setup, sequential_plan, config, run_dir=root / "sequential")
    splits = [
        await run_plan(setup, p, config, run_dir=root / p.label.replace("/", "-"))
        for p in split_plans
    ]
    dynarl = await run_plan(
        setup,
        dynarl_plan,
        config,
        run_dir=root / "dynarl",
        profiles=profiles_from(sequential, config),
    )
    return compare(dynarl, sequential, splits)


def _mean_step(result: RunResult) -> float:
    return statistics.fmean(s.wall_s for s in result.steps)


def sim_workload(config: ExperimentConfig, measured: RunResult) -> dict[str, Any]:
    """A simulator workload for this job on ``config.num_devices`` devices.

    Measured by the static-sequential run: the trainer's tokens per device-second, tool
    calls per episode, tokens per turn, weight-sync and phase-switch times. From the
    configuration: batch, tool latency, the scheduler's thresholds. Estimated: the
    engine's decode step (0.8 ms + 0.12 ms per running sequence, a microbenchmark of this
    model at batch 1 and 8 on one core), the migration pauses (0.1 s workload, 0.15 s P2P).
    """
    steps = measured.steps
    n = config.num_devices
    samples = config.num_prompts * config.group_size
    learn_s = statistics.fmean(s.phases.get("learn", 0.0) for s in steps)
    tokens = statistics.fmean(s.mean_response_tokens for s in steps) * samples
    switch_s = statistics.fmean(
        s.phases.get("switch", 0.0) + s.phases.get("barrier", 0.0) for s in steps
    )
    sync_s = statistics.fmean(s.phases.get("sync", 0.0) + s.phases.get("step", 0.0) for s in steps)
    turns = statistics.fmean(s.turns for s in steps) / samples
    hidden = config.hidden_size
    num_params = 12 * config.num_layers * hidden * hidden + 2 * 64 * hidden
    return {
        "name": "reference-cpu",
        "kind": "agentic" if config.task == "tool_calc" else "math",
        "seed": config.seed,
        "num_iterations": config.num_steps,
        "num_warmup_iterations": 0,
        "report_interval_s": 0.25,
        "cluster": {"num_gpus": n + 1, "num_gpus_per_node": n + 1, "gpu_memory_gib": 16.0},
        "model": {
            "name": "reference",
            "num_params": float(num_params),
            "num_layers": config.num_layers,
            "hidden_size": hidden,
            "kv_bytes_per_token": 2 * config.num_layers * hidden * 4,
            "state_bytes_per_param": 16.0,
            "sharded_state_fraction": 0.0,
        },
        "batch": {
            "num_prompts": config.num_prompts,
            "group_size": config.group_size,
            "num_minibatches": 1,
            "max_seq_len": 256,
        },
        "lengths": {
            "prompt_median": 12.0,
            "prompt_sigma": 0.3,
            "output_median": max(2.0, tokens / samples / max(turns, 1.0)),
            "output_sigma": 0.5,
        },
        "rollout": {
            "tp": 1,
            "kv_capacity_tokens": 4096,
            "max_running_requests": 32,
            "step_fixed_s": 0.0008,
            "step_per_seq_s": 0.00012,
            "step_per_kv_token_s": 1e-7,
            "prefill_tokens_per_s": 50000.0,
            "clip_max_new_tokens": config.max_response_tokens,
        },
        "inference": {"tp": 1, "tokens_per_s_per_gpu": 1e9, "min_gpus": 1},
        "trainer": {
            "tp": 1,
            "tokens_per_s_per_gpu": max(1.0, tokens / max(learn_s * n, 1e-3)),
            "min_gpus": 1,
        },
        "migration": {
            "workload_s": 0.1,
            "p2p_s": 0.15,
            "reboot_s": 1.0,
            "weight_sync_s": max(1e-3, sync_s),
            "phase_switch_s": max(1e-3, switch_s),
        },
        "agentic": {
            "mean_tool_calls": max(0.0, turns - 1.0),
            "max_tool_calls": 8,
            "turn_decay": 1.0,
            "tool_timeout_s": 30.0,
            "tool_latency_median_s": config.tool_median_s,
            "tool_latency_sigma": config.tool_sigma,
            "observation_median": 5.0,
            "observation_sigma": 0.3,
        },
        "scheduler": {
            "donor_fraction": 0.5,
            "util_low": config.util_low,
            "donor_window_s": config.donor_window_s,
            "stats_window_s": 5.0,
            "decision_interval_s": 0.25,
            "min_move_interval_s": config.min_move_interval_s,
            "max_prediction_error": 10.0,
            "num_devices_per_node": n + 1,
        },
    }


def _simulate(workload_dict: dict[str, Any], n: int, out: Any) -> None:
    workload = workload_from_dict(workload_dict)
    # The simulator's dynarl starts from a static partition (it models no sequential
    # phases) and its pipeline always has a log-prob inference stage with devices of its
    # own; the reference trainer scores its own samples, so that stage gets one extra
    # modelled device of unbounded throughput (it adds no time), the job's n devices
    # are split between rollout and trainer.
    partition = {"rollout": n - n // 2, "inference": 1, "trainer": n // 2}
    result = Simulation(workload, request_policy=FifoPolicy).run(DynarlPolicy(partition=partition))
    out.put(float(result.iteration_s))


def sim_prediction(
    config: ExperimentConfig, measured: RunResult, *, timeout_s: float = 120.0
) -> tuple[float | None, str]:
    """The simulator's mean iteration time of dynarl for this setup, or None and why
    (the simulator rejected the workload, or did not finish within ``timeout_s``)."""
    try:
        workload = sim_workload(config, measured)
        workload_from_dict(workload)
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"workload rejected: {exc}"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_simulate, args=(workload, config.num_devices, queue))
    child.start()
    try:
        return queue.get(timeout=timeout_s), ""
    except Empty:
        return None, f"the simulation did not finish within {timeout_s:.0f} s"
    finally:
        child.terminate()
        child.join(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--task", default="tool_calc", choices=("tool_calc", "chain_sum"))
    parser.add_argument("--cache", default="runs/.cache", help="warm-start cache directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = replace(
        ExperimentConfig(), num_steps=args.steps, num_devices=args.devices, task=args.task
    )
    setup = prepare_setup(config, args.cache)
    with tempfile.TemporaryDirectory(prefix="dynarl-e2e-") as tmp:
        result = asyncio.run(_all_runs(config, setup, Path(tmp)))
    runs = [result.dynarl, result.sequential, *result.splits]
    for run in runs:
        print(
            f"{run.label:>12}: {run.wall_s:7.2f} s  ({_mean_step(run):.2f} s/step)  "
            f"moves {run.scheduler_moves}  migrations {run.migrations}  "
            f"pause {run.pause_s:.2f} s  learned early "
            f"{sum(s.learned_early for s in run.steps)}"
        )
    predicted, why = sim_prediction(config, result.sequential)
    measured = _mean_step(result.dynarl)
    error = None if predicted is None else abs(predicted - measured) / measured
    if predicted is not None:
        print(f"simulator: dynarl {predicted:.2f} s/step predicted, {measured:.2f} measured")
    else:
        print(f"simulator: no prediction ({why})")
    sys.stdout.flush()
    print(
        json.dumps(
            {
                "speedup_vs_static": round(result.speedup_vs_sequential, 4),
                "speedup_vs_best_split": round(result.speedup_vs_best_split, 4),
                "best_split": result.best_split.label,
                "manifests_equal": result.manifests_equal,
                "rewards_equal": result.rewards_equal,
                "checksums_equal": result.checksums_equal,
                "sim_prediction_error": None if error is None else round(error, 4),
                "sim_note": why,
                "dynarl_s": round(result.dynarl.wall_s, 3),
                "sequential_s": round(result.sequential.wall_s, 3),
                "best_split_s": round(result.best_split.wall_s, 3),
                "num_steps": config.num_steps,
                "num_devices": config.num_devices,
                "task": config.task,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
