"""``dynarl demo --mode hybrid``: asynchronous GRPO with hybrid rollout replicas (verl-style).

The job (``dynarl.backends.reference``, the multi-turn calculator task by default) runs
as an asynchronous pipeline: a standalone rollout engine fills a bounded message queue;
the trainer takes fixed-size batches through a per-token staleness gate, updates, and
syncs the weights to the engines. It runs twice on the same CPU, seed, prompts and
initial weights, with the same number of samples:

* **standalone-only**: the trainer's device only trains (it waits when the queue is
  short: the ``static_fully_async`` policy);
* **hybrid**: the trainer's device also serves as a hybrid rollout replica under the
  ``default`` policy — activated after a weight sync when the queue falls behind (the
  trainer's state sleeps, an engine wakes there with the latest weights), deactivated
  before the next update (requests in flight are aborted with their partial output and
  resumed on the standalone engine; the engine sleeps; the trainer wakes).

Printed and written to the run directory: the ``dynamic_resource/*`` metrics side by
side (train, rollout and cluster utilization, the queue size), wall time, throughput,
staleness statistics, and whether the reward curves agree within the stated tolerance
(:func:`~dynarl.demo._tolerance.compare_curves`); ``events.jsonl`` (both runs' ledgers,
tagged), ``timeline.png``, ``curves.png``, ``summary.md``, ``steps.json``.
Runs in the CLI process (its own event loop); every worker process it starts is stopped
before it returns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["METRICS", "format_summary", "job_configs", "main", "write_run_dir"]

logger = logging.getLogger(__name__)

METRICS = (
    "dynamic_resource/train_resource_utilization",
    "dynamic_resource/rollout_resource_utilization",
    "dynamic_resource/resource_utilization",
    "dynamic_resource/mq_size",
)
"""The seed-004 metrics shown side by side (means over the steps)."""
LAST_K = 3
"""Steps whose rewards the tolerance test compares."""


def job_configs(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The job (``ExperimentConfig``) and the two pipelines (standalone-only, hybrid)."""
    from dynarl.demo._async_records import AsyncConfig
    from dynarl.demo._experiment import ExperimentConfig

    devices = args.devices or 2
    job = ExperimentConfig(
        num_devices=devices,
        seed=args.seed,
        task=args.task or "tool_calc",
        group_size=8,
        deterministic=False,
        **({"sft_steps": args.sft_steps} if getattr(args, "sft_steps", None) is not None else {}),
    )
    pipeline = AsyncConfig(
        num_devices=devices,
        num_standalone_devices=max(1, devices // 2),
        num_steps=args.steps or 6,
        num_groups=args.prompts or 4,
    )
    return job, _with(pipeline, hybrid=False), pipeline


def _with(config: Any, **changes: Any) -> Any:
    from dataclasses import replace

    return replace(config, **changes)


def main(args: argparse.Namespace) -> int:
    """Run the hybrid demo (``dynarl demo --mode hybrid``); the exit status."""
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        job, standalone, hybrid = job_configs(args)
    except ValueError as exc:
        print(f"dynarl demo: {exc}", file=sys.stderr)
        return 2
    from dynarl.plots import plots_extra

    with plots_extra("the demo's live view"):
        from rich.console import Console

    console = Console()
    run_dir = Path(args.out) / f"demo-hybrid-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    console.print(f"[bold]warm start[/bold] ({job.sft_steps} supervised steps, cached)")
    from dynarl.demo._experiment import prepare_setup

    setup = prepare_setup(job, Path(args.out) / ".cache")
    runs = asyncio.run(_runs(setup, job, (standalone, hybrid), run_dir, console))
    write_run_dir(run_dir, runs, group_size=job.group_size)
    total = time.perf_counter() - began
    print(format_summary(runs, group_size=job.group_size, run_dir=run_dir, total_s=total))
    return 0


async def _runs(
    setup: Any, job: Any, pipelines: Sequence[Any], run_dir: Path, console: Any
) -> list[Any]:
    from dynarl.demo._hybrid_job import run_async

    out = []
    for pipeline in pipelines:
        label = pipeline.label
        console.print(f"[bold]{label}[/bold]: {pipeline.num_steps} steps")

        def show(report: Any, label: str = label) -> None:
            console.print(
                f"  {label} step {report.step + 1}: reward {report.mean_reward:.3f}, "
                f"{report.wall_s:.2f} s (waited {report.wait_s:.2f} s), "
                f"hybrid {'active' if report.hybrid_active else 'asleep'}, "
                f"queue {report.metrics.get('dynamic_resource/mq_size', 0):.0f}",
                soft_wrap=True,
            )

        out.append(
            await run_async(
                setup,
                pipeline,
                run_dir=str(run_dir / label),
                runtime=job.runtime(),
                observer=show,
            )
        )
    return out


def _reward_check(runs: Sequence[Any], group_size: int) -> Any:
    from dynarl.demo._tolerance import compare_curves, group_means

    standalone, hybrid = runs
    curves = [[group_means(s.rewards, group_size) for s in r.steps] for r in (hybrid, standalone)]
    return compare_curves(curves[0], curves[1], last_k=min(LAST_K, len(hybrid.steps)))


def write_run_dir(run_dir: Path, runs: Sequence[Any], *, group_size: int) -> None:
    """``events.jsonl`` (both ledgers, each record tagged with its run), ``timeline.png``,
    ``curves.png``, ``summary.md`` and ``steps.json``."""
    from dynarl.plots import Allocation, allocation_timelines, line_panels

    with open(run_dir / "events.jsonl", "w", encoding="utf-8") as out:
        for result in runs:
            path = Path(result.run_dir) / "events.jsonl"
            if path.exists():
                for line in path.read_text(encoding="utf-8").splitlines():
                    out.write(json.dumps({**json.loads(line), "run": result.label}) + "\n")
    steps = {r.label: [asdict(s) for s in r.steps] for r in runs}
    (run_dir / "steps.json").write_text(json.dumps(steps, indent=1), encoding="utf-8")
    timelines = {}
    for r in runs:
        names = ("rollout", "trainer")
        timelines[f"{r.label}  ({r.wall_s:.1f} s)"] = Allocation(
            times=[t for t, _ in r.timeline],
            devices={n: [float(c.get(n, 0)) for _, c in r.timeline] for n in names},
            end=r.wall_s,
            marks=[s.began_s for s in r.steps],
            mark_names=[f"step {s.step}" for s in r.steps],
        )
    allocation_timelines(
        run_dir / "timeline.png",
        timelines,
        title="devices per component",
        mark_label="step start",
    )
    xs = {r.label: [float(s.step) for s in r.steps] for r in runs}

    def panel(value: Any) -> dict[str, tuple[list[float], list[float]]]:
        return {r.label: (xs[r.label], [float(value(s)) for s in r.steps]) for r in runs}

    line_panels(
        run_dir / "curves.png",
        {
            "mean reward": panel(lambda s: s.mean_reward),
            "loss": panel(lambda s: s.loss),
            "resource util.": panel(lambda s: s.metrics[METRICS[2]]),
            "queue (samples)": panel(lambda s: s.metrics[METRICS[3]]),
        },
        integer_x=True,
        title="asynchronous GRPO: standalone-only vs hybrid replicas",
    )
    text = format_summary(runs, group_size=group_size, run_dir=run_dir)
    (run_dir / "summary.md").write_text(text, "utf-8")


def format_summary(
    runs: Sequence[Any], *, group_size: int, run_dir: Path, total_s: float | None = None
) -> str:
    """The side-by-side, as Markdown (also what the terminal shows)."""
    standalone, hybrid = runs
    names = [m.split("/", 1)[1] for m in METRICS]
    lines = [
        "# dynarl demo --mode hybrid",
        "",
        "| run | wall (s) | samples | samples/s | " + " | ".join(names) + " | activations "
        "| aborted+resumed | rebalanced |",
        "|---|---|---|---|" + "---|" * len(names) + "---|---|---|",
    ]
    for r in runs:
        metrics = " | ".join(f"{r.mean_metric(m):.3f}" for m in METRICS)
        lines.append(
            f"| {r.label} | {r.wall_s:.1f} | {r.num_samples} | {r.throughput:.2f} | {metrics} "
            f"| {r.activations} | {len(r.aborted)} | {r.rebalanced} |"
        )
    check = _reward_check(runs, group_size)
    gain = hybrid.throughput / standalone.throughput
    lines += [
        "",
        f"- throughput of hybrid over standalone-only: **{gain:.2f}×**"
        f" (wall {standalone.wall_s:.1f} s → {hybrid.wall_s:.1f} s, same samples)",
        f"- reward, last {min(LAST_K, len(hybrid.steps))} steps (prompt-group means, "
        f"|Δ| ≤ 3·SE + 0.02): {check.describe()}",
        f"- where the gain comes from: each replica holds at most "
        f"s = {hybrid.config.concurrent_samples_per_replica} episodes in flight (verl's "
        "concurrent_samples_per_replica); the episodes mostly wait for the calculator, so "
        "the rollout is bound by that capacity (rollout_resource_utilization near 1), and "
        "the hybrid replica adds a second replica's capacity while the trainer would wait. "
        "On this CPU a standalone engine given 2·s does as well: the gain is capacity, "
        "not extra compute.",
        "",
        "| staleness | " + " | ".join(r.label for r in runs) + " |",
        "|---|---|---|",
    ]
    for key in standalone.staleness:
        values = " | ".join(f"{r.staleness[key]:g}" for r in runs)
        lines.append(f"| {key} | {values} |")
    lines += [
        "",
        "| step | " + " | ".join(f"{r.label} reward" for r in runs) + " |",
        "|---|---|---|",
    ]
    for a, b in zip(standalone.steps, hybrid.steps, strict=True):
        lines.append(f"| {a.step} | {a.mean_reward:.3f} | {b.mean_reward:.3f} |")
    lines += ["", f"run directory: {run_dir}"]
    if total_s is not None:
        lines.append(f"whole demo: {total_s:.0f} s")
    return "\n".join(lines)
