"""A worker killed outside a migration: its device is reclaimed and the job goes on, or the
job stops with one error (marker ``dist``).

Each case SIGKILLs one worker process while a step's generations are in flight (no
migration runs: the scheduler only observes), then checks what followed:

- a serving component's non-last worker: its items continue on the other worker, the
  trainer is untouched, the device leaves the allocation;
- a serving component's last worker: the scheduler gives it a device of the trainer (a P2P
  shrink, the trainer's state intact) and its items continue there;
- a trainer's only rank: the trainer is given a device of the rollout and restored from its
  last checkpoint (``DurableRun.recover`` then ``restore``); one of its two ranks (``slow``):
  restored on the other;
- and when the job cannot go on (a trainer with no checkpoint; a serving component's last
  worker with no device to replace it): one fatal WorkerLostError naming the component,
  the worker, the device and the signal, from whatever the loop was waiting on.

The durable runs then train to the end: every sample trained exactly once (the sample
manifest has no violation), the journalled step digests and the final trainer checksum
equal an uninterrupted run's (:mod:`fault_loop`). Every case is bounded by a timeout; no
timing is asserted.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import fault_loop
import pytest

from dynarl.errors import WorkerLostError
from dynarl.runtime import ComponentSpec, Job, JobConfig
from dynarl.runtime._durable_run import DurableRun
from dynarl.runtime.durable._source import SampleSource
from dynarl.testing import ScriptedRollout, TinyTrainer
from dynarl.types import MigrationKind

pytestmark = pytest.mark.dist

STEPS = 4


def kill(job: Job, device: int) -> int:
    """SIGKILL ``device``'s worker (its exit status left for the controller to read)."""
    pid = job.workers()[device]
    os.kill(pid, signal.SIGKILL)
    return pid


async def step_with_kill(job: Job, run: DurableRun, device: int) -> str:
    """One step whose generations are in flight when ``device``'s worker is killed; how
    it ended: ``continued`` (trained as is) or ``restored`` (the trainer lost its state)."""
    tickets = fault_loop.submit(job, run)
    await asyncio.sleep(0.2)  # generations in flight on the engines
    kill(job, device)
    samples = await fault_loop.collect(job, tickets)
    try:
        await run.train(samples)
    except WorkerLostError as lost:
        assert not lost.fatal and lost.component == "trainer" and lost.device == device
        recovery = await run.recover()
        assert recovery.restore_needed and recovery.respawned == ()
        checkpoint = run.checkpoint
        assert checkpoint is not None
        await run.restore()
        saved = run.store.manifest(checkpoint).metadata["trainer.checksum"]
        assert run.checksums["trainer"] == saved == await fault_loop.checksum(job)
        return "restored"
    return "continued"


async def finish(job: Job, run: DurableRun) -> None:
    """Train to ``STEPS``, then check exactly-once and the reference run's result."""
    while run.step < STEPS:
        await fault_loop.step(job, run)
    report = run.report()
    assert report.ok, report.violations
    digests, checksum = fault_loop.reference(STEPS)
    assert fault_loop.journal_digests(job.run_dir) == digests
    assert await fault_loop.checksum(job) == checksum


def test_a_killed_trainer_rank_is_restored_on_a_device_of_the_rollout(tmp_path: Path) -> None:
    async def main() -> None:
        async with asyncio.timeout(240), fault_loop.job(tmp_path) as job:
            run = await fault_loop.durable(job).open()
            await fault_loop.step(job, run)
            assert await step_with_kill(job, run, 2) == "restored"
            allocation = job.allocation.as_dict()
            assert allocation["trainer"] != [2] and len(allocation["rollout"]) == 1, allocation
            assert 2 in job.controller.link.losses.reclaimed
            await finish(job, run)

    asyncio.run(main())


@pytest.mark.slow
def test_a_trainer_that_lost_one_of_its_ranks_is_restored_on_the_other(tmp_path: Path) -> None:
    async def main() -> None:
        async with asyncio.timeout(240), fault_loop.job(tmp_path) as job:
            run = await fault_loop.durable(job).open()
            await fault_loop.step(job, run)
            grown = await job.move([1], src="rollout", dst="trainer")
            assert grown.ok, grown.reason
            assert await step_with_kill(job, run, 1) == "restored"
            assert job.allocation.as_dict() == {"rollout": [0], "trainer": [2]}
            await finish(job, run)

    asyncio.run(main())


def test_a_serving_components_workers_are_replaced_down_to_its_last(tmp_path: Path) -> None:
    specs = [
        ComponentSpec(role=ScriptedRollout, devices=(0, 1), options={"tokens_per_s": 60.0}),
        ComponentSpec(
            role=TinyTrainer,
            devices=(2, 3),
            options=fault_loop.TRAINER,
            migration=MigrationKind.P2P,
        ),
    ]
    config = JobConfig(run_dir=str(tmp_path), runtime=fault_loop.runtime(), durable=True)

    async def main() -> None:
        async with asyncio.timeout(300), Job(specs, config) as job:
            run = await fault_loop.durable(job).open()
            await fault_loop.step(job, run)
            # Not the last: its items continue on worker 0.
            assert await step_with_kill(job, run, 1) == "continued"
            assert job.allocation.as_dict() == {"rollout": [0], "trainer": [2, 3]}
            # The last: the trainer gives up a device (a P2P shrink) and the rollout runs there.
            assert await step_with_kill(job, run, 0) == "continued"
            allocation = job.allocation.as_dict()
            assert len(allocation["rollout"]) == 1 and len(allocation["trainer"]) == 1
            assert set(allocation["rollout"] + allocation["trainer"]) == {2, 3}
            assert run.resumed_from is None  # never restored: the trainer's state went on
            await finish(job, run)
            # Its last worker again: no component can spare a device now.
            (last,) = allocation["rollout"]
            tickets = fault_loop.submit(job, run)
            await asyncio.sleep(0.2)
            pid = kill(job, last)
            with pytest.raises(WorkerLostError) as stopped:
                await fault_loop.collect(job, tickets)
            error = stopped.value
            assert error.fatal and error.component == "rollout" and error.device == last
            assert error.cause == "killed by SIGKILL"
            assert f"'worker/{last}' on device {last} (pid {pid}, killed by SIGKILL)" in str(error)
            assert "the job cannot go on" in str(error)
            with pytest.raises(WorkerLostError):
                await job.call("trainer", "checksum")

    asyncio.run(main())


def test_a_trainer_with_no_checkpoint_stops_the_job_with_one_error(tmp_path: Path) -> None:
    """The issue's loop (examples/custom_loop.py's shape, no DurableRun): the trainer's
    worker dies while the loop waits for samples."""
    specs = [
        ComponentSpec(role=ScriptedRollout, devices=(0, 1), options={"tokens_per_s": 20.0}),
        ComponentSpec(role=TinyTrainer, devices=(2,), options=fault_loop.TRAINER),
    ]
    config = JobConfig(run_dir=str(tmp_path), runtime=fault_loop.runtime())
    tickets = SampleSource(fault_loop.SOURCE).take(4)
    requests = [fault_loop.request(t, i) for i, t in enumerate(tickets)]

    async def main() -> None:
        with pytest.raises(WorkerLostError) as stopped:
            async with asyncio.timeout(120), Job(specs, config) as job:
                job.submit("rollout", requests)
                out = job.output("rollout")
                await job.call("trainer", "train_step", [await out.get()])
                pid = kill(job, 2)
                while True:  # the loop goes on waiting, as a user's would
                    await job.call("trainer", "train_step", [await out.get()])
        error = stopped.value
        assert error.fatal and error.component == "trainer" and error.device == 2
        assert str(error).startswith(
            f"component 'trainer' lost worker 'worker/2' on device 2 (pid {pid}, killed by "
            "SIGKILL): its state lived there and no checkpoint can restore it"
        )
        # Raised on its own: no bus error shows through it.
        assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)

    asyncio.run(main())
