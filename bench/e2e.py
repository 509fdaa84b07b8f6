"""dynarl against static schedules on the reference GRPO job (the demo's job), end to end.

Runs the job (two worker processes by default, deterministic mode, the same seed) under
static sequential, every static split and dynarl, one after the other on this machine,
then asks the simulator (``dynarl.sim``) to predict the same setup — the same components
on the same devices, built from what the static-sequential run measured and the engine's
decode step measured here (:func:`sim_workload`; never from the dynarl run it predicts).
Prints a table and, last, one JSON line:

- ``speedup_vs_static``: static-sequential wall time / dynarl wall time (target >= 1.15);
- ``speedup_vs_best_split``: best static split wall time / dynarl's (target >= 1.0);
- ``manifests_equal``: per-step sample ids, micro-batches and update order identical;
- ``sim_prediction_error``: |S_pred - S| / S, S = ``speedup_vs_static`` measured and
  S_pred = the simulator's static-sequential iteration time over its dynarl iteration
  time (target <= 0.15). The speedup, not a wall time, because it is what the simulator
  is for (what dynamic scheduling gains over the static schedule) and because the
  absolute speed of a 2-core machine shared with other work swings between runs, which
  the ratio cancels; ``sim_dynarl_step_error`` gives |predicted - measured| / measured
  of dynarl's mean step time too.

Wall times are measured on a shared machine: run it more than once and read the spread.

``--engine vllm`` runs the same job on real vLLM engines (one server per device, started
once) and the Megatron trainer (:mod:`dynarl.demo._engine_demo`), every schedule
``--repetitions`` times alternating, and prints, last, one JSON line: ``speedup_vs_static``
and ``speedup_vs_best_split`` (medians), ``ratios`` (every repetition's run over dynarl's),
``manifests_equal``, ``versions_as_expected``, ``replay_checksums_equal`` and
``logprob_max_abs_diff`` (see :class:`~dynarl.demo._engine_demo.EngineComparison`); no
simulator prediction there.

    .venv/bin/python bench/e2e.py [--steps N] [--devices N] [--task tool_calc|chain_sum]
        [--engine reference|vllm] [--prompts N] [--repetitions N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from queue import Empty
from typing import Any

import torch

from dynarl.backends.reference._request import GenerationRequest as EngineRequest
from dynarl.backends.reference._rollout_engine import RolloutEngine
from dynarl.demo._experiment import (
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
from dynarl.sim.policies._static import StaticSequential


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


def decode_constants(setup: Any, *, num_steps: int = 30) -> tuple[float, float]:
    """Seconds of one decode step of the job's engine on this machine: the part that does
    not depend on the batch and the part per running sequence (a fit through batch 1 and
    ``num_slots``, measured here, one compute thread, deterministic decoding)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        batches = (1, setup.engine.num_slots)
        for batch in batches:
            engine = RolloutEngine(setup.model, setup.engine)
            engine.load_weights(setup.initial_weights(), 0)
            for i in range(batch):
                prompt = tuple(1 + (i + j) % 40 for j in range(16))
                engine.submit(EngineRequest(sample_id=i, prompt=prompt, max_new_tokens=200))
            engine.step()  # prefill
            began = time.perf_counter()
            for _ in range(num_steps):
                engine.step()
            seconds[batch] = (time.perf_counter() - began) / num_steps
    finally:
        torch.set_num_threads(threads)
    per_seq = max(1e-6, (seconds[batches[1]] - seconds[1]) / (batches[1] - 1))
    return max(1e-6, seconds[1] - per_seq), per_seq


def sim_workload(
    config: ExperimentConfig, measured: RunResult, decode: tuple[float, float]
) -> dict[str, Any]:
    """A simulator workload for this job on ``config.num_devices`` devices — the same
    components (rollout engines and the trainer; the trainer scores its own log-probs,
    so the simulator's inference stage is fused: no time, no device) on the same devices.

    Measured by the static-sequential run: the trainer's tokens per device-second, tool
    calls and generated tokens per turn, weight-sync and phase-switch times. Measured here
    (:func:`decode_constants`): the engine's decode step. From the configuration: batch,
    KV capacity, the calculator's latency (its cap as the tool timeout), the
    scheduler's thresholds. Estimated: migration pauses (0.1 s workload, 0.15 s P2P).
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
    calls = max(0.0, turns - 1.0)
    observation = 5.0  # "{" + a result of 1-3 digits + "}"
    per_turn = (tokens / samples - calls * observation) / max(turns, 1.0)
    hidden = config.hidden_size
    num_params = 12 * config.num_layers * hidden * hidden + 2 * 64 * hidden
    fixed_s, per_seq_s = decode
    return {
        "name": "reference-cpu",
        "kind": "agentic" if config.task == "tool_calc" else "math",
        "seed": config.seed,
        "num_iterations": config.num_steps,
        "num_warmup_iterations": 0,
        "report_interval_s": 0.25,
        "cluster": {"num_gpus": n, "num_gpus_per_node": n, "gpu_memory_gib": 16.0},
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
            "prompt_median": 16.0,
            "prompt_sigma": 0.2,
            "output_median": max(2.0, per_turn),
            "output_sigma": 0.3,
        },
        "rollout": {
            "tp": 1,
            "kv_capacity_tokens": 4096,
            "max_running_requests": 32,
            "step_fixed_s": fixed_s,
            "step_per_seq_s": per_seq_s,
            "step_per_kv_token_s": 0.0,
            "prefill_tokens_per_s": 1.0 / per_seq_s,
            "clip_max_new_tokens": config.max_response_tokens,
        },
        "inference": {"tp": 1, "tokens_per_s_per_gpu": math.inf, "min_gpus": 0},
        "trainer": {
            "tp": 1,
            "tokens_per_s_per_gpu": max(1.0, tokens / max(learn_s * n, 1e-3)),
            "min_gpus": 0,
        },
        "migration": {
            "workload_s": 0.1,
            "p2p_s": 0.15,
            "reboot_s": 1.0,
            "weight_sync_s": max(1e-3, sync_s),
            "phase_switch_s": max(1e-3, switch_s),
        },
        "agentic": {
            "mean_tool_calls": calls,
            "max_tool_calls": 2 * config.max_products - 1,
            "turn_decay": 1.0,
            "tool_timeout_s": config.tool_max_s,
            "tool_latency_median_s": config.tool_median_s,
            "tool_latency_sigma": config.tool_sigma,
            "observation_median": observation,
            "observation_sigma": 0.2,
        },
        "scheduler": {
            "donor_fraction": 0.5,
            "util_low": config.util_low,
            "donor_window_s": config.donor_window_s,
            "stats_window_s": max(5.0, config.donor_window_s),
            "decision_interval_s": 0.25,
            "min_move_interval_s": config.min_move_interval_s,
            "max_prediction_error": 10.0,
            "num_devices_per_node": n,
        },
    }


def _simulate(workload_dict: dict[str, Any], n: int, out: Any) -> None:
    workload = workload_from_dict(workload_dict)
    # Both start as the job does: every device generates; dynarl's trainer holds none
    # until the scheduler gives it one (and returns to that at every barrier).
    partition = {"rollout": n, "inference": 0, "trainer": 0}
    times = {}
    for name, policy in (
        ("sequential", StaticSequential()),
        ("dynarl", DynarlPolicy(partition=partition)),
    ):
        result = Simulation(workload, request_policy=FifoPolicy).run(policy)
        times[name] = float(result.iteration_s)
    out.put(times)


def sim_prediction(
    config: ExperimentConfig,
    measured: RunResult,
    decode: tuple[float, float],
    *,
    timeout_s: float = 180.0,
) -> tuple[dict[str, float] | None, str]:
    """The simulator's mean iteration time of static-sequential and of dynarl for this
    setup, or None and why (the simulator rejected the workload, or did not finish within
    ``timeout_s``)."""
    try:
        workload = sim_workload(config, measured, decode)
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
    parser.add_argument("--engine", default="reference", choices=("reference", "vllm"))
    parser.add_argument("--prompts", type=int, default=8, help="vllm: prompts per step")
    parser.add_argument("--repetitions", type=int, default=3, help="vllm: runs per schedule")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.engine == "vllm":
        return _engine_main(args)
    config = replace(
        ExperimentConfig(), num_steps=args.steps, num_devices=args.devices, task=args.task
    )
    setup = prepare_setup(config, args.cache)
    decode = decode_constants(setup)
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
    predicted, why = sim_prediction(config, result.sequential, decode)
    measured = _mean_step(result.dynarl)
    error = step_error = None
    if predicted is not None:
        speedup = predicted["sequential"] / predicted["dynarl"]
        error = abs(speedup - result.speedup_vs_sequential) / result.speedup_vs_sequential
        step_error = abs(predicted["dynarl"] - measured) / measured
        print(
            f"simulator: sequential {predicted['sequential']:.2f} s/step, dynarl "
            f"{predicted['dynarl']:.2f} s/step predicted ({speedup:.3f}x); measured "
            f"{_mean_step(result.sequential):.2f} and {measured:.2f} "
            f"({result.speedup_vs_sequential:.3f}x); decode step {decode[0] * 1e3:.2f} ms "
            f"+ {decode[1] * 1e3:.3f} ms per sequence"
        )
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
                "sim_dynarl_step_error": None if step_error is None else round(step_error, 4),
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


def _engine_main(args: argparse.Namespace) -> int:
    """``--engine vllm``: the repetitions on real engines; the JSON line last."""
    import os

    from dynarl.demo._engine_demo import (
        EngineDemoConfig,
        EnginePool,
        prepare_model,
        run_repetitions,
    )

    experiment = replace(
        ExperimentConfig(),
        num_steps=args.steps,
        num_devices=args.devices,
        task=args.task,
        num_prompts=args.prompts,
    )
    config = EngineDemoConfig(
        experiment=experiment,
        repetitions=args.repetitions,
        python=os.environ.get("DYNARL_VLLM_PYTHON", sys.executable),
    )
    model = prepare_model(config, args.cache)

    async def runs(root: Path) -> Any:
        async with EnginePool(model, config, log_dir=root / "engines") as pool:
            return await run_repetitions(
                config, experiment.setup(), model, pool, root, note=lambda text: print(text)
            )

    with tempfile.TemporaryDirectory(prefix="dynarl-e2e-vllm-") as tmp:
        comparison = asyncio.run(runs(Path(tmp)))
    for label, results in comparison.runs.items():
        walls = ", ".join(f"{r.wall_s:.2f}" for r in results)
        print(f"{label:>12}: median {comparison.medians[label]:7.2f} s  ({walls})")
    sys.stdout.flush()
    figures = comparison.to_json() | {
        "num_steps": experiment.num_steps,
        "num_prompts": experiment.num_prompts,
        "num_devices": experiment.num_devices,
        "task": experiment.task,
        "repetitions": config.repetitions,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
