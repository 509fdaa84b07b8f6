"""``dynarl demo --engine vllm``, one step of each schedule (the smoke ``make test`` runs):
the GRPO job on two real vLLM servers and the Megatron trainer, under static sequential,
the 1/1 split and dynarl, through the CLI as a user runs it.

What must hold however the engines batch: the runs' manifests are identical, every trained
token carries the weight version its step expects, the replay of the dynarl run's samples on
a fresh trainer in the static-sequential layout gives its checksum bitwise, and the engines'
log-probs of the trained tokens are the trainer's within an fp32 bound. Speed is not judged
here (``bench/e2e.py --engine vllm``). The demo starts and stops its own two servers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dynarl.cli import main

pytestmark = pytest.mark.engines

LOGPROB_BOUND = 1e-3
"""fp32 on both sides, different kernels and batch shapes: measured ~1.5e-5."""


def test_one_step_of_every_schedule_on_vllm_engines_agrees(
    engine_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYNARL_VLLM_PYTHON", engine_python)
    code = main(
        [
            "demo", "--engine", "vllm", "--steps", "1", "--prompts", "2", "--repetitions", "1",
            "--sft-steps", "20", "--no-live", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    (run_dir,) = tmp_path.glob("demo-vllm-*")
    figures = json.loads((run_dir / "figures.json").read_text())
    assert code == 0, (run_dir / "summary.md").read_text()
    assert set(figures["walls_s"]) == {"sequential", "split-1/1", "dynarl"}
    assert figures["manifests_equal"] is True
    assert figures["versions_as_expected"] is True and figures["stale_tokens"] == 0
    assert figures["replay_checksums_equal"] is True
    assert 0.0 <= figures["logprob_max_abs_diff"] < LOGPROB_BOUND
    steps = json.loads((run_dir / "steps.json").read_text())
    for label in ("sequential #1", "split-1/1 #1", "dynarl #1"):
        (step,) = steps[label]
        assert step["turns"] >= 2 * 16  # every episode of both groups generated at least once
        assert step["logprob_gap"] is not None
    # the servers were stopped: no process of this test's engine interpreter is left
    # running on the demo's model
    model = str(tmp_path / ".cache")
    leftover = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, model)]
    assert leftover == []


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def test_the_vllm_demo_refuses_without_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-python"
    monkeypatch.setenv("DYNARL_VLLM_PYTHON", str(missing))
    assert not os.path.exists(missing)
    code = main(["demo", "--engine", "vllm", "--no-live", "--out", str(tmp_path)])
    assert code == 2
    assert "DYNARL_VLLM_PYTHON" in capsys.readouterr().err
