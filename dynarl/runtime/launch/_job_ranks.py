"""A :class:`~dynarl.runtime.JobSpec` under torchrun: the ranks are its workers.

On rank 0, :class:`SpecJob` builds the spec (a factory is called there only) and runs its
:class:`~dynarl.runtime.Job` with a :class:`RankLauncher`: the controller is built as on
one machine, but instead of spawning processes the launcher writes the workers' settings
(a :class:`~dynarl.runtime.worker.WorkerOptions`, from the spec's ``RuntimeConfig``) into
the attempt's store and opens the rendezvous. On every rank, rank ``r``'s worker — a
:class:`~dynarl.runtime.worker.WorkerAgent`, device ``r`` — reads them, registers with the
controller and serves until told to leave. When the driver returns or raises, rank 0 writes
the outcome (``ok``, or ``failed: <error>``) into the store; the other ranks end with it:
0, or WorkerError naming rank 0's error. Runs on each rank's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

import msgspec

from dynarl._resource import AsyncResource
from dynarl.bus import CurveServer
from dynarl.errors import DeadlineExceeded, WorkerError
from dynarl.runtime._job_spec import JobSpec
from dynarl.runtime.worker import WorkerAgent, WorkerOptions, prepare_process

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from dynarl.runtime.launch._torchrun import ControllerContext, WorkerContext

__all__ = ["JobFactory", "RankLauncher", "SpecJob", "describe"]

logger = logging.getLogger(__name__)

_OPTIONS_KEY = "worker-options"
"""Store key (in the attempt's space) of the workers' settings, written by rank 0."""
_OUTCOME_KEY = "outcome"
"""Store key of the job's outcome: ``ok``, or ``failed: <error>``."""
_POLL_S = 0.1


class RankLauncher(AsyncResource):
    """The :class:`~dynarl.runtime.launch.WorkerLauncher` of a job under torchrun: every
    rank runs its worker already, so :meth:`start` starts no process; it writes the
    workers' settings into the attempt's store and opens the rendezvous (``announce``).
    The controller binds where ``context`` says, with its CURVE settings, and uses the
    attempt's store. Runs on rank 0's event loop.
    """

    def __init__(self, context: ControllerContext) -> None:
        self._context = context

    async def _open(self, stack: AsyncExitStack) -> None:
        """Nothing to open: torchrun started the processes."""

    @property
    def store(self) -> Store | None:
        """The attempt's space of the job's TCPStore."""
        return self._context.store

    @property
    def bind(self) -> str:
        """``tcp://<--bind-host>:0``."""
        return self._context.bind_address

    @property
    def curve(self) -> CurveServer | None:
        """The controller's CURVE settings (None without CURVE)."""
        return self._context.curve

    async def start(self, workers: Sequence[WorkerOptions]) -> None:
        """Publish the workers' settings (those of the first: every rank's differ only
        in the device), then admit the ranks. Raises WorkerError for a device that is
        not a rank of this job."""
        ranks = self._context.env.world_size
        if any(options.device >= ranks for options in workers):
            raise WorkerError(f"a worker was asked for a device beyond the {ranks} ranks")
        if not workers:
            return
        settings = msgspec.json.encode(workers[0]).decode()
        await asyncio.to_thread(self._context.store.set, _OPTIONS_KEY, settings)
        self._context.announce(workers[0].controller)

    def check(self) -> None:
        """Nothing to check here: a rank that dies is a peer the controller loses."""

    def exited(self) -> tuple[int, ...]:
        """None: torchrun restarts ranks itself."""
        return ()

    def kill(self, device: int) -> None:
        """Refused: the controller does not own the ranks' processes."""
        raise WorkerError(f"cannot kill rank {device}'s worker: torchrun owns its process")

    def pids(self) -> dict[int, int]:
        """None known: the ranks' processes are torchrun's."""
        return {}


JobFactory = Callable[[Sequence[str]], JobSpec]
"""A function of the job's arguments (after ``--``) returning its spec."""


class SpecJob:
    """Runs a :class:`~dynarl.runtime.JobSpec` as a :class:`LaunchedJob`."""

    def __init__(self, target: JobSpec | JobFactory) -> None:
        self._target = target

    async def controller(self, context: ControllerContext) -> None:
        """Rank 0: build the spec, run its Job with the ranks as workers, record the
        outcome for the other ranks. Raises what the job raises."""
        try:
            spec = await asyncio.to_thread(self._spec, context)
            await spec.run(launcher=RankLauncher(context))
        except BaseException as exc:
            await _publish(context.store, f"failed: {describe(exc)}")
            raise
        await _publish(context.store, "ok")

    def _spec(self, context: ControllerContext) -> JobSpec:
        target = self._target
        spec = target if isinstance(target, JobSpec) else target(context.config.args)
        if not isinstance(spec, JobSpec):
            raise ValueError(f"--job {context.config.job} returned {spec!r}, not a JobSpec")
        ranks = context.env.world_size
        if spec.num_devices > ranks:
            raise ValueError(
                f"the job needs {spec.num_devices} devices but torchrun started {ranks} ranks "
                "(--nnodes x --nproc-per-node)"
            )
        config = dataclasses.replace(
            spec.config, run_dir=str(context.config.job_dir), num_devices=ranks
        )
        return dataclasses.replace(spec, config=config)

    async def worker(self, context: WorkerContext) -> None:
        """Every rank: serve as the worker of device ``rank`` until the controller says
        leave, then exit as the job did. Raises WorkerError when the worker left for
        another reason or the job failed, DeadlineExceeded when rank 0 never says."""
        rank = context.env.rank
        timeout = context.config.store_timeout_s
        raw = await _wait_for(context.store, _OPTIONS_KEY, timeout, f"rank {rank}")
        # --pin-cores pinned this process already: its roles (engine servers) see the core.
        cpus = tuple(sorted(os.sched_getaffinity(0))) if context.config.pin_cores else ()
        options = dataclasses.replace(
            msgspec.json.decode(raw, type=WorkerOptions),
            controller=context.address, device=rank, store_port=0, cpus=cpus,
        )  # fmt: skip
        prepare_process(options)
        agent = WorkerAgent(options, store=context.store, curve=context.curve)
        try:
            status = await agent.run()
        finally:
            gc.unfreeze()
        if status != 0:
            why = "the controller was lost" if status == 1 else "its engine died"
            raise WorkerError(f"rank {rank}: its worker left with status {status} ({why})")
        outcome = (await _wait_for(context.store, _OUTCOME_KEY, timeout, f"rank {rank}")).decode()
        if outcome != "ok":
            raise WorkerError(f"rank {rank}: the job failed on rank 0: {outcome}")


async def _publish(store: Store, outcome: str) -> None:
    try:
        await asyncio.to_thread(store.set, _OUTCOME_KEY, outcome)
    except Exception as exc:  # the outcome is best effort: the job's own error wins
        logger.warning("could not record the outcome %r: %r", outcome, exc)


async def _wait_for(store: Store, key: str, timeout_s: float, who: str) -> bytes:
    """The value of ``key`` once it is set (polled: a cancelled wait leaves no thread
    blocked). Raises DeadlineExceeded after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(store.check, [key]):
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"{who}: rank 0 wrote no {key!r} within {timeout_s} s")
        await asyncio.sleep(_POLL_S)
    return await asyncio.to_thread(store.get, key)


def describe(exc: BaseException) -> str:
    """``Type: message`` of every error in ``exc`` (an ExceptionGroup's leaves)."""
    leaves = _leaves(exc)
    return "; ".join(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__ for e in leaves)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]
