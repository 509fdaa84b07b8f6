"""examples/torchrun_two_node.sh: two torchrun "nodes" on loopback, CURVE on, the example
job's controller spreads requests over both ranks and checks every answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parent.parent.parent
TIMEOUT_S = 240


def test_the_two_node_torchrun_example_runs() -> None:
    script = ROOT / "examples" / "torchrun_two_node.sh"
    env = dict(os.environ, PYTHON=sys.executable)
    # Its own session: on a timeout the script, both torchruns and their ranks go as one.
    process = subprocess.Popen(
        ["bash", str(script), "6"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=30)
    assert process.returncode == 0, err[-4000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("result: "), out
    result = json.loads(last.removeprefix("result: "))
    assert result == {
        "workers": ["rank-0", "rank-1"],
        "samples": 6,
        "by_rank": {"0": 3, "1": 3},
        "wrong": [],
        "curve": True,
    }
