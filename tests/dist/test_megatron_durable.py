"""The production trainer in a durable job: checkpoints that restore on another layout, and
the reboot migration.

The durable loop of ``tests/fault_loop.py`` with ``MegatronTrainerRole`` (a tiny
Megatron-core GPT on gloo) as its trainer, trained by the layout-independent streamed step.

- **P2P job:** step 0 on device 2; three times the trainer grows onto device 1 and
  shrinks back (no worker's open file descriptors grow); it grows onto device 1 by a P2P
  reshard; step 1 on both ranks ends with a checkpoint (every other step: each rank
  writes its shards); the trainer shrinks back to device 2 and trains step 2. Restoring
  then rolls it back to the two-rank checkpoint on one rank (``DurableRun.restore``
  checks the restored checksum against the saved one), and step 2 is trained again.
- **Reboot job:** the trainer moves from device 2 to device 1 and then grows onto devices
  1 and 2 by reboot migrations (``save_state`` on the old devices, fresh roles,
  ``load_state`` on the new), training a step between the moves.

Both end on the checksum of the same loop run without a move or a restore, and every
move keeps the state.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import fault_loop
import psutil
import pytest

from dynarl.runtime import Job, RuntimeConfig
from dynarl.runtime._durable_run import DurableConfig, DurableRun
from dynarl.types import Allocation, MigrationKind

# Under ``slow`` (~70 s): in ``make test`` the chaos minute (``tests/dist/test_chaos.py``)
# checkpoints this trainer on two ranks, restores it on one and compares with a clean run.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.gloo_listener_outlives_test]

STEPS = 3
MEGATRON = fault_loop.Stack(name="megatron")


def settings() -> RuntimeConfig:
    """The loop's settings, with room for a joining rank to import Megatron and build its
    model inside a migration step on two loaded cores."""
    return dataclasses.replace(
        fault_loop.runtime(), collective_timeout_s=90.0, request_timeout_s=120.0
    )


async def open_fds_over_moves(job: Job, *, cycles: int) -> list[dict[int, int]]:
    """Grow the trainer onto device 1 and shrink it back ``cycles`` times; each worker's
    open file descriptors after every cycle."""
    pids = job.workers()
    counts = []
    for _ in range(cycles):
        for src, dst in (("rollout", "trainer"), ("trainer", "rollout")):
            moved = await job.move([1], src=src, dst=dst)
            assert moved.ok, moved.reason
        counts.append({device: psutil.Process(pid).num_fds() for device, pid in pids.items()})
    return counts


async def p2p_job(run_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    running = fault_loop.job(run_dir, config=settings(), stack=MEGATRON)
    async with asyncio.timeout(400), running as job:
        config = DurableConfig(
            source=fault_loop.SOURCE, checkpoint_every=2, max_tokens=fault_loop.MAX_NEW
        )
        run = await DurableRun(job, config).open()
        await fault_loop.step(job, run)
        out["fds"] = await open_fds_over_moves(job, cycles=3)
        before = await fault_loop.checksum(job)
        grown = await job.move([1], src="rollout", dst="trainer")
        out["grow"] = (grown.ok, grown.reason, await fault_loop.checksum(job) == before)
        await fault_loop.step(job, run)  # on two ranks; the checkpoint follows
        out["saved"] = await fault_loop.checksum(job)
        out["saved_devices"] = run.store.manifest(run.checkpoint).metadata["trainer.devices"]
        shrunk = await job.move([1], src="trainer", dst="rollout")
        out["shrink"] = (shrunk.ok, shrunk.reason, await fault_loop.checksum(job) == out["saved"])
        await fault_loop.step(job, run)
        out["first_try"] = await fault_loop.checksum(job)
        await run.restore()
        out["restored"] = await fault_loop.checksum(job)
        out["restored_devices"] = job.allocation.devices("trainer")
        out["step_after_restore"] = run.step
        await fault_loop.step(job, run)
        out["final"] = await fault_loop.checksum(job)
        out["violations"] = [v.kind for v in run.report().violations]
    return out


async def reboot_job(run_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"moves": []}
    running = fault_loop.job(
        run_dir, trainer=MigrationKind.REBOOT, config=settings(), stack=MEGATRON
    )
    targets = (
        Allocation.of({"rollout": [0, 2], "trainer": [1]}),
        Allocation.of({"rollout": [0], "trainer": [1, 2]}),
    )
    async with asyncio.timeout(400), running as job:
        run = await fault_loop.durable(job).open()
        for target in targets:
            await fault_loop.step(job, run)
            before = await fault_loop.checksum(job)
            moved = await job.reallocate(target)
            after = await fault_loop.checksum(job)
            out["moves"].append((moved.ok, moved.reason, job.allocation == target, after == before))
        await fault_loop.step(job, run)
        out["final"] = await fault_loop.checksum(job)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("megatron-durable")

    async def all_runs() -> dict[str, Any]:
        return {
            "p2p": await p2p_job(root / "p2p"),
            "reboot": await reboot_job(root / "reboot"),
            "clean": await fault_loop.clean_run(root / "clean", STEPS, MEGATRON),
        }

    return asyncio.run(all_runs())


def test_a_checkpoint_written_by_two_ranks_restores_on_one(runs: dict[str, Any]) -> None:
    p2p = runs["p2p"]
    assert p2p["grow"] == (True, p2p["grow"][1], True)
    assert p2p["shrink"] == (True, p2p["shrink"][1], True)
    assert p2p["saved_devices"] == "1,2"
    assert p2p["restored_devices"] == (2,)
    assert p2p["step_after_restore"] == 2
    assert p2p["restored"] == p2p["saved"] != p2p["first_try"]
    assert p2p["violations"] == []


def test_layout_changes_leave_no_file_descriptor_behind(runs: dict[str, Any]) -> None:
    # Each layout's gloo groups hold sockets, pipes and epoll instances; Megatron keeps
    # them in reference cycles, freed at the commit that retires the layout.
    first, *later = runs["p2p"]["fds"]
    assert all(counts == first for counts in later), runs["p2p"]["fds"]


def test_the_redone_step_and_the_moves_change_nothing_the_loop_computes(
    runs: dict[str, Any],
) -> None:
    p2p, (_, clean) = runs["p2p"], runs["clean"]
    assert p2p["final"] == p2p["first_try"] == clean


def test_reboot_migrations_move_the_trainer_with_its_state(runs: dict[str, Any]) -> None:
    reboot, (_, clean) = runs["reboot"], runs["clean"]
    for ok, reason, arrived, kept in reboot["moves"]:
        assert ok, reason
        assert arrived and kept
    assert reboot["final"] == clean
