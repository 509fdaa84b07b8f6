"""A job with real workers ends cleanly however it ends: a role that cannot start on its
devices (the rendezvous stage), an error raised by the user's ``async with`` body, the
task running the job cancelled while it runs.

Each test runs a durable one-worker job; the conftest leak check fails it on any ZeroMQ
socket, child process, TCPStore server, listening socket or asyncio task left behind, and
the test checks the journal is closed. The stages before the workers run role code are in
``tests/unit/test_job_lifecycle.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dynarl.errors import RemoteError, WorkerError
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.testing import ScriptedRollout

pytestmark = pytest.mark.dist

GOOD = ComponentSpec(role=ScriptedRollout, devices=(0,))


def job_in(run_dir: Path, spec: ComponentSpec = GOOD) -> Job:
    return Job([spec], JobConfig(run_dir=str(run_dir), durable=True, runtime=RuntimeConfig()))


def assert_closed(job: Job) -> None:
    assert job.workers() == {}
    assert job.journal is not None
    with pytest.raises(ValueError, match="closed"):
        job.journal.complete_step(0, cursor=0)


def test_a_role_that_cannot_start_fails_the_rendezvous_stage_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    # The worker builds the role with this option and fails: float("fast").
    broken = ComponentSpec(role=ScriptedRollout, devices=(0,), options={"tokens_per_s": "fast"})
    job = job_in(tmp_path, broken)

    async def main() -> None:
        async with asyncio.timeout(240), job:
            pytest.fail("the job started")

    with pytest.raises(WorkerError) as caught:
        asyncio.run(main())
    err = caught.value
    assert str(err).startswith("start-up failed at stage 'rendezvous': "), err
    assert isinstance(err.__cause__, RemoteError), repr(err.__cause__)
    assert "fast" in str(err)
    assert_closed(job)


class Boom(Exception):
    pass


def test_an_error_in_the_body_propagates_unchanged_and_leaves_nothing(tmp_path: Path) -> None:
    job = job_in(tmp_path)

    async def main() -> None:
        async with asyncio.timeout(240), job:
            assert job.allocation.devices("rollout") == (0,)
            raise Boom("the user's loop failed")

    with pytest.raises(Boom, match="the user's loop failed"):
        asyncio.run(main())
    assert_closed(job)


def test_cancelling_the_task_running_a_job_leaves_nothing(tmp_path: Path) -> None:
    job = job_in(tmp_path)

    async def main() -> None:
        running = asyncio.Event()

        async def use() -> None:
            async with job:
                running.set()
                await asyncio.Event().wait()  # the user's loop, until cancelled

        task = asyncio.create_task(use())
        async with asyncio.timeout(240):
            await running.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert_closed(job)
