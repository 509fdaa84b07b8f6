"""The demo's outputs: the side-by-side summary, the run directory, the figures.

The runs are built by hand here (the real job runs under tests/dist and in the slow test
at the bottom, which runs ``dynarl demo`` itself).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dynarl.demo._demo import format_summary, write_run_dir
from dynarl.demo._device_schedules import RunPlan, Schedule, StepReport
from dynarl.demo._experiment import RunResult, compare
from dynarl.runtime import ForeignLoad


def step(
    index: int, *, wall: float, checksum: str = "c", ids: tuple[str, ...] = ("1", "2")
) -> StepReport:
    return StepReport(
        step=index,
        mean_reward=0.25 * index,
        rewards=(0.0, 0.5 * index),
        loss=0.1 / (index + 1),
        kl=0.0,
        grad_norm=1.0,
        version=index + 1,
        checksum=f"{checksum}{index}",
        manifest=ids,
        micro_sizes=(len(ids),),
        wall_s=wall,
        rollout_s=wall / 2,
        learned_early=1 if checksum == "d" else 0,
        resumed=0,
        turns=len(ids),
        mean_response_tokens=10.0,
        max_response_tokens=20,
        phases={"rollout": wall / 2, "learn": wall / 4},
    )


def run(label: str, plan: RunPlan, wall: float, tmp: Path, **kw: object) -> RunResult:
    directory = tmp / label.replace("/", "-")
    directory.mkdir()
    (directory / "events.jsonl").write_text(json.dumps({"type": "X", "time": 1.0}) + "\n")
    return RunResult(
        label=label,
        plan=plan,
        steps=tuple(step(i, wall=wall / 2, **kw) for i in range(2)),  # type: ignore[arg-type]
        wall_s=wall,
        timeline=((0.0, {"rollout": 2, "trainer": 0}), (1.0, {"rollout": 1, "trainer": 1})),
        step_starts=(0.0, wall / 2),
        scheduler_moves=2 if label == "dynarl" else 0,
        migrations=4,
        pause_s=0.5,
        reshards_verified=2,
        run_dir=str(directory),
    )


def test_summary_and_run_directory(tmp_path: Path) -> None:
    dynarl = run("dynarl", RunPlan(schedule=Schedule.DYNARL), 8.0, tmp_path)
    seq = run("sequential", RunPlan(schedule=Schedule.SEQUENTIAL), 10.0, tmp_path)
    split = run("split-1/1", RunPlan(schedule=Schedule.SPLIT), 9.0, tmp_path)
    comparison = compare(dynarl, seq, [split])
    assert comparison.speedup_vs_sequential == pytest.approx(1.25)
    assert comparison.speedup_vs_best_split == pytest.approx(1.125)
    assert comparison.manifests_equal and comparison.rewards_equal
    text = format_summary(comparison, run_dir=tmp_path)
    assert "speedup over static sequential: **1.25×**" in text
    assert "best static split (split-1/1): **1.12×**" in text
    assert "identical: **yes**" in text
    out = tmp_path / "out"
    out.mkdir()
    write_run_dir(out, comparison)
    for name in ("events.jsonl", "timeline.png", "curves.png", "summary.md", "steps.json"):
        assert (out / name).stat().st_size > 0, name
    assert "foreign load: not measured" in text
    runs = {json.loads(line)["run"] for line in (out / "events.jsonl").read_text().splitlines()}
    assert runs == {"dynarl", "sequential", "split-1/1"}


def test_a_different_manifest_is_reported(tmp_path: Path) -> None:
    dynarl = run("dynarl", RunPlan(schedule=Schedule.DYNARL), 8.0, tmp_path, ids=("2", "1"))
    seq = run("sequential", RunPlan(schedule=Schedule.SEQUENTIAL), 10.0, tmp_path)
    split = run("split-1/1", RunPlan(schedule=Schedule.SPLIT), 9.0, tmp_path)
    comparison = compare(dynarl, seq, [split])
    assert not comparison.manifests_equal
    assert "identical: **NO**" in format_summary(comparison, run_dir=tmp_path)


def load(foreign_cores: float) -> ForeignLoad:
    """A 10 s run whose job took 15 CPU-s, other processes ``foreign_cores`` on average."""
    return ForeignLoad(wall_s=10.0, busy_s=15.0 + 10 * foreign_cores, own_s=15.0)


def test_a_comparison_under_foreign_load_says_so(tmp_path: Path) -> None:
    dynarl = run("dynarl", RunPlan(schedule=Schedule.DYNARL), 8.0, tmp_path)
    seq = run("sequential", RunPlan(schedule=Schedule.SEQUENTIAL), 10.0, tmp_path)
    split = run("split-1/1", RunPlan(schedule=Schedule.SPLIT), 9.0, tmp_path)
    quiet = compare(replace(dynarl, load=load(0.05)), replace(seq, load=load(0.0)),
                    [replace(split, load=load(0.1))])  # fmt: skip
    text = format_summary(quiet, run_dir=tmp_path)
    assert "foreign load: none (at most 0.10 cores in any run)" in text
    assert "| 0.05 |" in text and "under foreign load" not in text
    loaded = compare(replace(dynarl, load=load(0.05)), replace(seq, load=load(0.7)),
                     [replace(split, load=load(0.1))])  # fmt: skip
    assert [r.label for r in loaded.loaded_runs] == ["sequential"]
    assert "**measured under foreign load**: other processes took CPU during sequential 0.70" in (
        format_summary(loaded, run_dir=tmp_path)
    )
    out = tmp_path / "out"
    out.mkdir()
    write_run_dir(out, loaded)
    assert json.loads((out / "load.json").read_text())["sequential"]["foreign_cores"] == 0.7


def test_foreign_load_never_counts_below_zero() -> None:
    # The two clocks tick apart: the job's own seconds may exceed the cores' busy ones.
    odd = ForeignLoad(wall_s=2.0, busy_s=3.0, own_s=3.2)
    assert odd.foreign_s == 0.0 and not odd.loaded
    assert ForeignLoad(wall_s=0.0, busy_s=1.0, own_s=0.0).foreign_cores == 0.0


@pytest.mark.slow
def test_the_demo_runs_every_schedule_and_writes_its_run_directory(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "dynarl.cli", "demo", "--no-live", "--steps", "2",
        "--prompts", "8", "--out", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "manifests (sample ids, micro-batches, update order) identical: **yes**" in (
        result.stdout
    )
    (run_dir,) = tmp_path.glob("demo-*")
    for name in ("events.jsonl", "timeline.png", "curves.png", "summary.md"):
        assert (run_dir / name).exists(), name
