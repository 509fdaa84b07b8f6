"""The reference GRPO job on the runtime: what it computes does not depend on the schedule.

One small job (two worker processes, the multi-turn calculator task, deterministic mode)
runs under static sequential, a static split and dynarl with a scheduler tuned to move
devices as soon as it can (mid-rollout: generations are aborted and resumed elsewhere).
ARCHITECTURE §10: the per-step manifests (sample ids, micro-batch composition, update
order) are identical; in deterministic mode so are the rewards and the trainer's state
(parameters and Adam moments, by SHA-256) after every step; every reshard of the trainer
keeps its checksum. Under dynarl the scheduler really moved devices and the trainer
really learned micro-batches before the rollout ended.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from reference_support import SMALL_JOB, eager

from dynarl.demo._device_schedules import RunPlan, Schedule
from dynarl.demo._experiment import (
    RunResult,
    compare,
    prepare_setup,
    profiles_from,
    run_plan,
)

pytestmark = pytest.mark.dist

# The shared small job, deterministic, under a scheduler that moves mid-rollout.
CONFIG = eager(SMALL_JOB, deterministic=True, num_steps=2, num_prompts=6, sft_steps=150)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("reference-job")
    setup = prepare_setup(CONFIG, root / "cache")

    async def all_runs() -> dict[str, RunResult]:
        out: dict[str, RunResult] = {}
        for name, plan, config in (
            ("sequential", RunPlan(schedule=Schedule.SEQUENTIAL), CONFIG),
            ("split", RunPlan(schedule=Schedule.SPLIT, num_rollout_devices=1), CONFIG),
            ("dynarl", RunPlan(schedule=Schedule.DYNARL), CONFIG),
            # The scheduler never finds a donor (no utilization is below 0): the trainer
            # wakes at each barrier, grows onto both devices by P2P and shrinks back
            # (always: on this tiny job growing would not pay for itself).
            (
                "barrier",
                RunPlan(schedule=Schedule.DYNARL),
                replace(CONFIG, util_low=0.0, always_grow=True),
            ),
        ):
            # dynarl's predictor starts from the sequential run's figures (as the demo's).
            profiles = profiles_from(out["sequential"], CONFIG) if out else None
            out[name] = await run_plan(
                setup, plan, config, run_dir=Path(root) / name, profiles=profiles
            )
        return out

    return asyncio.run(all_runs())


def test_manifests_rewards_and_parameters_identical_across_schedules(
    runs: dict[str, RunResult],
) -> None:
    result = compare(runs["dynarl"], runs["sequential"], [runs["split"], runs["barrier"]])
    assert result.manifests_equal
    assert result.rewards_equal
    assert result.checksums_equal
    steps = runs["sequential"].steps
    assert [len(s.manifest) for s in steps] == [CONFIG.num_prompts * CONFIG.group_size] * 2
    # The state really changed through gradients (not only Adam's step counter).
    assert len({s.checksum for s in steps}) == CONFIG.num_steps
    assert any(s.grad_norm > 0 for s in steps)


def test_dynarl_moved_devices_and_learned_before_the_rollout_ended(
    runs: dict[str, RunResult],
) -> None:
    dynarl = runs["dynarl"]
    assert dynarl.scheduler_moves >= 1
    assert sum(s.learned_early for s in dynarl.steps) >= 1
    assert runs["sequential"].scheduler_moves == 0 and runs["split"].migrations == 0


def test_every_trainer_reshard_kept_the_state_checksum(runs: dict[str, RunResult]) -> None:
    # The driver checks the trainer's checksum before and after each of its P2P reshards
    # (growing at a barrier, shrinking back); a mismatch would have failed the run.
    dynarl = runs["barrier"]
    reshards = 0
    for line in (Path(dynarl.run_dir) / "events.jsonl").read_text().splitlines():
        record = json.loads(line)
        if (
            record["type"] == "MigrationRecord"
            and record["kind"] == "p2p"
            and record["outcome"] == "committed"
            and record["decision_id"].startswith("op")
            and record["src_devices"]
            and record["dst_devices"]
        ):
            reshards += 1
    assert reshards == 2 * CONFIG.num_steps
    assert dynarl.reshards_verified == reshards
