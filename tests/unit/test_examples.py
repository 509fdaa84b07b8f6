"""The examples a user starts from run, and say what they claim to show.

(``examples/custom_loop.py`` and ``examples/torchrun_two_node.sh`` start processes: they
run under ``tests/dist``.)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = ROOT / "examples"


def run(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_custom_predictor_example_moves_devices_with_both_predictors() -> None:
    out = run(str(EXAMPLES / "custom_predictor.py"))
    counts = dict(re.findall(r"^(amdahl|default): (\d+) move\(s\)$", out, re.MULTILINE))
    assert set(counts) == {"amdahl", "default"}, out
    assert all(int(n) >= 1 for n in counts.values()), out
    # Every committed move hands rollout devices to the bottleneck trainer.
    moves = re.findall(r"\{'rollout': (\d+), 'trainer': (\d+)\} -> \{'rollout': (\d+)", out)
    assert moves and all(int(after) < int(before) for before, _, after in moves), out
    assert "amdahl learned rates: {'rollout'" in out


def test_the_custom_policy_example_runs_every_order_and_the_hybrid_policy() -> None:
    out = run(str(EXAMPLES / "custom_policy.py"))
    for order in ("fifo", "priority", "cache-first"):
        assert re.search(rf"^  {order} +\d+\.\d+ episodes/s", out, re.MULTILINE), out
    steps = re.findall(r"^  step (\d): hybrid (active|asleep)", out, re.MULTILINE)
    # warmup_steps=2: asleep for steps 0 and 1, whatever comes after.
    assert steps[:2] == [("0", "asleep"), ("1", "asleep")], out
    assert ("2", "active") in steps, out


def test_the_user_property_test_of_the_custom_policies_passes() -> None:
    # A user's own test file, run as the user would: pytest on examples/, with only
    # dynarl.testing's strategies.
    out = run(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLES / "test_custom_policy.py")
    )
    assert re.search(r"\b3 passed\b", out), out


def test_the_scheduler_in_virtual_time_moves_the_tail_to_the_trainer() -> None:
    out = run(str(EXAMPLES / "sched_virtual_time.py"))
    assert re.search(r"move: \{'rollout': 12, 'trainer': 4\} -> \{'rollout': \d+", out), out
    assert "commit: saves" in out and "hold: no donor" in out


def test_the_reshard_plan_example_prints_its_plans() -> None:
    out = run(str(EXAMPLES / "reshard_plan.py"))
    assert re.search(r"-> tp\d+-pp\d+-dp\d+", out), out
    assert "weight sync to" in out


@pytest.mark.slow
def test_the_reference_grpo_example_trains() -> None:
    out = run(str(EXAMPLES / "reference_grpo.py"), timeout=600)
    steps = re.findall(r"^step +(\d+) +reward (\d\.\d+)", out, re.MULTILINE)
    assert len(steps) >= 2, out
    assert out.startswith("warm-up loss") and "generated" in out.splitlines()[-1]
