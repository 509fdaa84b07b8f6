"""A job's start-up fails cleanly at every stage before its workers run role code.

For each stage of :class:`~dynarl.runtime.Job` start-up a failure is injected at that
stage — for real where this machine can make it fail (a damaged journal, a taken metrics
port, a worker interpreter that does not exist, one that exits, one that never
registers), through a monkeypatched seam where it cannot (the store, the publisher, the
bus bind) — and the job must raise the stage's error, naming the stage and chained to the
cause, with nothing left afterwards: the conftest leak check fails the test on any ZeroMQ
socket, child process, TCPStore server, listening socket or asyncio task left behind.
Cancelling the task that starts the job leaves nothing either. The later stages, which
need real workers (rendezvous, the user's body, cancellation of a running job), are in
``tests/dist/test_job_lifecycle_dist.py``.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from torch._C import _distributed_c10d as c10d

from dynarl.bus import _pubsub, _server
from dynarl.errors import BusError, DynarlError, IntegrityError, WorkerError
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.runtime.durable import _journal
from dynarl.runtime.durable._journal import Journal, frame
from dynarl.runtime.durable._journal_records import StepCompleted
from dynarl.testing import ScriptedRollout

SPECS = [ComponentSpec(role=ScriptedRollout, devices=(0,))]


def refuse(what: str) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EADDRINUSE, f"{what}: address already in use")

    return fail


def script(path: Path, body: str) -> str:
    """An executable that stands in for the workers' interpreter."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@dataclass(frozen=True)
class Stage:
    name: str
    error: type[DynarlError]
    cause: type[BaseException]
    inject: Callable[[pytest.MonkeyPatch, Path], dict[str, Any]]
    """Sets the failure up; returns JobConfig and RuntimeConfig fields (``runtime.`` ones)."""


def damaged_journal(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir()
    (run_dir / "journal").write_bytes(frame(StepCompleted(step=0, cursor=0, time=0.0)))
    return {}


def no_store(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> dict[str, Any]:
    monkeypatch.setattr(c10d, "TCPStore", refuse("store"))
    return {}


def no_publisher(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> dict[str, Any]:
    monkeypatch.setattr(_pubsub, "open_publisher", refuse("publisher"))
    return {}


def no_bus(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> dict[str, Any]:
    monkeypatch.setattr(_server, "open_router", refuse("bus"))
    return {}


def taken_metrics_port(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> dict[str, Any]:
    return {"runtime.metrics_port": "taken"}


def no_interpreter(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> dict[str, Any]:
    return {"python": str(run_dir.parent / "no-such-python")}


def exiting_worker(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> dict[str, Any]:
    return {"python": script(run_dir.parent / "exits", "exit 3")}


def silent_worker(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> dict[str, Any]:
    python = script(run_dir.parent / "sleeps", "exec sleep 60")
    return {"python": python, "runtime.start_timeout_s": 1.0}


STAGES = [
    Stage("journal open", IntegrityError, IntegrityError, damaged_journal),
    Stage("store", WorkerError, OSError, no_store),
    Stage("publisher", BusError, OSError, no_publisher),
    Stage("bus bind", BusError, OSError, no_bus),
    Stage("metrics port", DynarlError, OSError, taken_metrics_port),
    Stage("worker spawn", WorkerError, FileNotFoundError, no_interpreter),
    Stage("worker registration", WorkerError, WorkerError, exiting_worker),
    Stage("worker registration", WorkerError, TimeoutError, silent_worker),
]


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def job_for(fields: dict[str, Any], run_dir: Path, port: int) -> Job:
    runtime = {k.removeprefix("runtime."): v for k, v in fields.items() if "." in k}
    if runtime.get("metrics_port") == "taken":
        runtime["metrics_port"] = port
    config = {k: v for k, v in fields.items() if "." not in k}
    return Job(
        SPECS,
        JobConfig(run_dir=str(run_dir), durable=True, runtime=RuntimeConfig(**runtime), **config),
    )


@pytest.mark.parametrize(
    "stage", STAGES, ids=[f"{s.name}-{s.inject.__name__}".replace(" ", "_") for s in STAGES]
)
def test_a_failure_at_each_start_up_stage_names_it_and_leaves_nothing(
    stage: Stage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    run_dir = tmp_path / "run"
    job = job_for(stage.inject(monkeypatch, run_dir), run_dir, taken_port)

    async def main() -> None:
        async with job:
            pytest.fail("the job started")

    with pytest.raises(DynarlError) as caught:
        asyncio.run(main())
    err = caught.value
    assert type(err) is stage.error
    assert str(err).startswith(f"start-up failed at stage {stage.name!r}: "), err
    assert isinstance(err.__cause__, stage.cause), repr(err.__cause__)
    assert job.workers() == {}
    if stage.name != "journal open":
        assert job.journal is not None
        with pytest.raises(ValueError, match="closed"):
            job.journal.complete_step(0, cursor=0)


def test_cancelling_the_task_that_starts_a_job_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = script(tmp_path / "sleeps", "exec sleep 60")
    job = Job(SPECS, JobConfig(run_dir=str(tmp_path / "run"), durable=True, python=python))

    async def main() -> None:
        spawned = asyncio.Event()
        spawn = job._launcher.spawn

        def spawn_and_tell(options: Any) -> int:
            pid = spawn(options)
            spawned.set()
            return pid

        monkeypatch.setattr(job._launcher, "spawn", spawn_and_tell)

        async def start() -> None:
            async with job:
                pytest.fail("the job started")

        task = asyncio.create_task(start())
        async with asyncio.timeout(60):
            await spawned.wait()  # the job now waits for the worker to register
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert job.workers() == {}
    assert job.journal is not None
    with pytest.raises(ValueError, match="closed"):
        job.journal.complete_step(0, cursor=0)


def test_a_journal_that_fails_part_way_through_opening_closes_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_journal, "_fsync_directory", refuse("fsync"))
    before = len(list(Path("/proc/self/fd").iterdir()))
    with pytest.raises(OSError, match="fsync"):
        Journal(tmp_path / "journal")
    assert len(list(Path("/proc/self/fd").iterdir())) == before
