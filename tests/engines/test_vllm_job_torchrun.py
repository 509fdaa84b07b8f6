"""The production job file (``examples/vllm_job.py``: a real vLLM engine launched by device 0's
worker, the Megatron-core trainer on device 1, ``--grow``: after each rollout the engine
sleeps, the trainer grows onto its device by a P2P reshard and shrinks back) under two
torchruns on this machine — two "nodes" of one rank each, so the trainer's reshards and its
weight pushes cross the nodes — and on the local launcher.

A batching engine does not give bitwise-equal tokens from run to run, so the two runs are
compared on what must agree: the manifests (sample ids by micro-batch, in update order);
every trained token sampled under the step's weight version; the engine's log-probs of the
trained tokens equal to the trainer's within an fp32 bound; the trainer's state changed by
every step; and the ledger holds the reshards across the nodes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torchrun_support import committed_reshards, local_and_torchrun

pytestmark = [pytest.mark.engines, pytest.mark.slow]  # ~3 min on two cores: two vLLM starts

ARGS = ["--steps", "2", "--prompts", "3", "--group-size", "4", "--sft-steps", "20", "--grow"]
LOGPROB_BOUND = 1e-3


def test_the_vllm_job_file_under_torchrun_agrees_with_the_local_launcher(
    engine_python: str, tmp_path: Path
) -> None:
    if engine_python != sys.executable:
        pytest.skip("the job's workers launch vLLM with their own interpreter")
    args = [*ARGS, "--cache", str(tmp_path / "cache")]
    local_steps, launched, _ = local_and_torchrun(tmp_path, "vllm_job.py", "vllm_job:job", args)
    assert len(launched) == 2
    for here, there in zip(local_steps, launched, strict=True):
        assert here["manifest"] == there["manifest"]
        for run in (here, there):
            assert run["stale_tokens"] == 0
            assert 0.0 <= float(run["logprob_gap"]) < LOGPROB_BOUND  # type: ignore[arg-type]
            assert run["learned_on"] == [0, 1]  # the trainer moved onto the engine's device
            assert run["allocation"] == {"rollout": [0], "trainer": [1]}
    for run in (local_steps, launched):
        assert run[0]["checksum"] != run[1]["checksum"]
    job_dir = tmp_path / "torchrun" / "job"
    assert committed_reshards(job_dir) == [([1], [0, 1]), ([0, 1], [1])] * 2
