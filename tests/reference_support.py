"""A small reference job shared by the asynchronous and tolerance tests (one warm start)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dynarl.demo._experiment import ExperimentConfig

SMALL_JOB = ExperimentConfig(
    num_devices=2,
    task="tool_calc",
    group_size=4,
    hidden_size=64,
    num_layers=2,
    max_response_tokens=64,
    tool_median_s=0.1,
    tool_sigma=0.3,
    lr=1e-3,
    sft_steps=100,
    deterministic=False,
)
"""Two devices, the calculator task, a 64-wide GPT warmed up by 100 supervised steps,
not deterministic (asynchronous or statistical comparisons; a test may ask for
deterministic)."""


def eager(config: ExperimentConfig, **changes: object) -> ExperimentConfig:
    """``config`` (with ``changes``) under a scheduler that moves as soon as it can — every
    engine counts as idle at once, so it moves a device mid-rollout — and with every rollout
    starting on both devices."""
    return replace(
        config,
        util_low=1.0,
        donor_window_s=0.1,
        min_move_interval_s=0.1,
        resume_where_left=False,
        **changes,  # type: ignore[arg-type]
    )


def shared_cache(factory: pytest.TempPathFactory) -> Path:
    """One warm start per test session (the configuration's key tells warm starts apart)."""
    return factory.getbasetemp() / "reference-warm-start"
