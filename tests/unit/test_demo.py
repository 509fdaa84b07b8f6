"""The demo's components do real work; the whole demo runs and stops what it starts."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

from dynarl import ComponentKind
from dynarl.bus import ChannelTable, unpack_tokens
from dynarl.demo import BATCH, NEW_TOKENS, PROMPT, VOCAB, ToyRollout, ToyTrainer


def test_rollout_samples_and_trainer_steps_are_real_torch_work() -> None:
    assert ToyRollout.spec.kind is ComponentKind.ROLLOUT
    assert ToyTrainer.spec.kind is ComponentKind.TRAINER
    table = ChannelTable()
    samples = ToyRollout(0, table)._generate(0)
    assert len(samples) == BATCH
    for sample in samples:
        tokens = unpack_tokens(sample.token_ids)
        assert len(tokens) == PROMPT + NEW_TOKENS and 0 <= tokens.min() and tokens.max() < VOCAB
        assert sample.reward is not None and 0.0 <= sample.reward <= 1.0
    trainer = ToyTrainer(0, table)
    before = [p.detach().clone() for p in trainer._policy.parameters()]  # type: ignore[attr-defined]
    loss = trainer._step(samples)
    after = list(trainer._policy.parameters())  # type: ignore[attr-defined]
    assert math.isfinite(loss)
    assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))


@pytest.mark.slow
def test_the_demo_runs_and_stops_every_process() -> None:
    command = [sys.executable, "-m", "dynarl.cli", "demo", "--duration", "8", "--workers", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "stopped all 4 processes this demo started" in out
    done = {m[0]: int(m[1].replace(",", "")) for m in re.findall(r"(\w+) .* done ([\d,]+)", out)}
    assert done["rollout"] > 0 and done["trainer"] > 0, out
