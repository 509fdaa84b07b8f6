"""A real ``dynarl.Job`` launched by torchrun from a job file (``examples/torchrun_job.py``:
the reference rollout engine and trainer, two GRPO steps, deterministic mode; ``--grow``:
after each rollout the trainer grows onto the rollout's device by a P2P reshard, learns
data-parallel, and shrinks back).

The same job file runs (a) under two torchruns on this machine — two "nodes" of one rank
each, c10d rendezvous on loopback, each torchrun its own process group: the controller, the
loop and device 0's worker on rank 0, device 1's worker on the other node, so the trainer's
reshards and the weight syncs cross the nodes — and (b) on the local launcher
(``JobSpec.run``: one worker process per device). Their per-step manifests (sample ids by
micro-batch, in update order) are equal, and so are the rewards and the trainer's state
checksums. A job whose driver fails ends every rank with a non-zero status,
the error named in the logs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_support import committed_reshards, local_and_torchrun, two_nodes

pytestmark = pytest.mark.dist

JOB_ARGS = ["--steps", "2", "--prompts", "3", "--group-size", "4", "--grow"]


@pytest.mark.slow  # ~50 s on two cores; make test runs the job file under torchrun through
# tests/dist/test_examples_launch.py (examples/torchrun_two_node.sh)
def test_a_job_file_under_torchrun_trains_as_on_the_local_launcher(tmp_path: Path) -> None:
    args = [*JOB_ARGS, "--cache", str(tmp_path / "cache")]
    local_steps, launched, logs = local_and_torchrun(
        tmp_path, "torchrun_job.py", "torchrun_job:job", args
    )
    assert "rank 1: the job ended" in logs and "rank 0: the job ended" in logs
    assert len(launched) == 2
    for here, there in zip(local_steps, launched, strict=True):
        assert here["manifest"] == there["manifest"]
        assert here["rewards"] == there["rewards"]
        assert here["checksum"] == there["checksum"]
        assert there["learned_on"] == [0, 1]  # the trainer really moved, across the nodes
        assert there["allocation"] == {"rollout": [0], "trainer": [1]}
    # The trainer took its steps: its state differs after each.
    assert launched[0]["checksum"] != launched[1]["checksum"]
    # The torchrun job's run directory is --job-dir (no worker process was spawned there);
    # its ledger holds the trainer's reshards between the ranks, grow and shrink each step.
    job_dir = tmp_path / "torchrun" / "job"
    assert not (job_dir / "workers").exists()
    assert committed_reshards(job_dir) == [([1], [0, 1]), ([0, 1], [1])] * 2


def test_a_failing_driver_ends_every_rank_with_the_error_named(tmp_path: Path) -> None:
    codes, logs = two_nodes(tmp_path, "torchrun_jobs:failing", [])
    assert codes[0] != 0 and codes[1] != 0, logs[-6000:]
    assert "rank 0: the job failed: RuntimeError: the driver gave up" in logs, logs[-6000:]
    assert "the job failed on rank 0: failed: RuntimeError: the driver gave up" in logs
