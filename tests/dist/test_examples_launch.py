"""examples/torchrun_two_node.sh: two torchrun "nodes" on loopback, CURVE on, run the job
file examples/torchrun_job.py (a reference GRPO job: the rollout on rank 0, the trainer on
the other node); it takes two GRPO steps."""

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


@pytest.mark.slow  # test_netns_job runs two torchrun nodes in make test
def test_the_two_node_torchrun_example_runs() -> None:
    script = ROOT / "examples" / "torchrun_two_node.sh"
    env = dict(os.environ, PYTHON=sys.executable)
    # Its own session: on a timeout the script, both torchruns and their ranks go as one.
    process = subprocess.Popen(
        ["bash", str(script), "2"],
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
    assert result["num_devices"] == 2
    steps = result["steps"]
    assert len(steps) == 2
    assert all(s["allocation"] == {"rollout": [0], "trainer": [1]} for s in steps)
    assert all(len(s["rewards"]) == sum(map(len, s["manifest"])) > 0 for s in steps)
    assert steps[0]["checksum"] != steps[1]["checksum"]  # the trainer stepped
