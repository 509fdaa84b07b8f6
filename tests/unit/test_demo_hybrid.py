"""``dynarl demo --mode hybrid``: its side-by-side, its run directory, and (slow) the demo.

The runs are built by hand here; the real pipeline runs in tests/dist/test_hybrid_job.py
and in the slow test at the bottom, which runs the demo itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynarl.demo._async_records import AsyncConfig, AsyncRunResult, AsyncStepReport
from dynarl.demo._demo import add_arguments
from dynarl.demo._hybrid_demo import METRICS, format_summary, job_configs, write_run_dir


def report(index: int, *, hybrid: bool) -> AsyncStepReport:
    rewards = (1.0, 0.0, 1.0, 1.0) if index else (0.0, 0.0, 1.0, 0.0)
    return AsyncStepReport(
        step=index,
        trainer_version=index,
        version=index + 1,
        mean_reward=sum(rewards) / 4,
        rewards=rewards,
        loss=0.1,
        kl=0.0,
        sample_ids=("1", "2", "3", "4"),
        versions=(f"{index}*3",) * 4,
        resumed=(0, 1, 0, 0),
        began_s=2.0 * index,
        wall_s=2.0,
        wait_s=0.5,
        update_s=1.0,
        sync_s=0.1,
        deactivate_s=0.1 if hybrid else 0.0,
        wait_for_samples_s=0.5 if hybrid else 0.0,
        activate_s=0.2 if hybrid else 0.0,
        hybrid_active=hybrid,
        metrics={name: 0.5 for name in METRICS},
    )


def run(tmp: Path, *, hybrid: bool) -> AsyncRunResult:
    config = AsyncConfig(num_steps=3, num_groups=2, hybrid=hybrid)
    directory = tmp / config.label
    directory.mkdir()
    (directory / "events.jsonl").write_text(json.dumps({"type": "X", "time": 1.0}) + "\n")
    return AsyncRunResult(
        label=config.label,
        config=config,
        steps=tuple(report(i, hybrid=hybrid) for i in range(3)),
        wall_s=5.0 if hybrid else 6.0,
        staleness={"samples": 12.0, "max_staleness": 1.0},
        activations=2 if hybrid else 0,
        deactivations=2 if hybrid else 0,
        aborted=(("7", 3, 1),) if hybrid else (),
        rebalanced=1 if hybrid else 0,
        replica_log=(("add_replicas", 0),) if hybrid else (),
        timeline=((0.0, {"rollout": 1, "trainer": 1}), (1.0, {"rollout": 2, "trainer": 0})),
        run_dir=str(directory),
    )


def test_summary_and_run_directory(tmp_path: Path) -> None:
    runs = [run(tmp_path, hybrid=False), run(tmp_path, hybrid=True)]
    text = format_summary(runs, group_size=2, run_dir=tmp_path)
    assert "throughput of hybrid over standalone-only: **1.20×**" in text
    assert "| hybrid | 5.0 | 12 | 2.40 |" in text
    assert "train_resource_utilization" in text and "mq_size" in text
    assert "within tolerance" in text
    write_run_dir(tmp_path, runs, group_size=2)
    for name in ("events.jsonl", "timeline.png", "curves.png", "summary.md", "steps.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    tags = [
        json.loads(line)["run"] for line in (tmp_path / "events.jsonl").read_text().splitlines()
    ]
    assert tags == ["standalone-only", "hybrid"]


def test_the_cli_options_reach_the_pipelines() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--mode", "hybrid", "--steps", "3", "--prompts", "2", "--seed", "4"])
    job, standalone, hybrid = job_configs(args)
    assert job.seed == 4 and not job.deterministic and job.num_devices == 2
    assert (standalone.hybrid, hybrid.hybrid) == (False, True)
    assert hybrid.num_steps == standalone.num_steps == 3
    assert hybrid.num_groups == 2 and hybrid.policy == "default"


@pytest.mark.slow
def test_the_hybrid_demo_runs_both_pipelines_and_writes_its_run_directory(
    tmp_path: Path,
) -> None:
    command = [
        sys.executable, "-m", "dynarl.cli", "demo", "--mode", "hybrid", "--steps", "3",
        "--prompts", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "throughput of hybrid over standalone-only" in result.stdout
    (run_dir,) = tmp_path.glob("demo-hybrid-*")
    for name in ("events.jsonl", "timeline.png", "curves.png", "summary.md", "steps.json"):
        assert (run_dir / name).exists(), name
    steps = json.loads((run_dir / "steps.json").read_text())
    assert [len(steps[label]) for label in ("standalone-only", "hybrid")] == [3, 3]
