"""Worker losses: how the controller learns that a worker process died, and what it knows.

A worker can die outside any migration (killed, out of memory, its host gone). The signs
reach the controller as *suspicions*, which it judges on its own loop:

- the bus declares the worker's peer lost (missed heartbeats) or gone (it left);
- a request to the worker fails at the transport (its connection is gone, so nothing can
  even be sent), or a call on its component fails: the serving path and the group
  managers name the worker, or every worker of the component, as suspect;
- every tick, each worker on this host is probed: each registered with its pid, and
  :func:`exit_cause` reads how a process ended without reaping it (``os.waitid`` with
  ``WNOWAIT``: the exit status stays for the launcher that started it).

:class:`Losses` holds what the controller knows: every worker's registration, the
suspects, the confirmed :class:`WorkerLoss` es and the devices reclaimed after them.
From :meth:`Losses.lose` on, a request to that worker fails at once with PeerLostError
(:meth:`Losses.unless_lost`) instead of waiting for the bus to notice. When the job cannot
go on, :meth:`Losses.fail` records its one error, a fatal
:class:`~dynarl.errors.WorkerLostError`; every call, submission and channel operation of
the job then raises it, and those already waiting are woken with it
(:meth:`Losses.unless_failed`, :class:`GuardedChannels`). Runs on the controller's event
loop.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dynarl.bus import ChannelBackend, GenerationRequest, Sample
from dynarl.errors import PeerLostError, WorkerLostError

__all__ = ["GuardedChannels", "Losses", "WorkerLoss", "exit_cause"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerLoss:
    """One worker process that died: which, where, and how."""

    device: int
    """Its device."""
    cause: str
    """How it ended: ``"killed by SIGKILL"``, ``"exited with status 1"``, ``"missed
    heartbeats"``."""
    pid: int = 0
    """Its process id (0: unknown)."""
    component: str = ""
    """The component it hosted ("" for none)."""

    @property
    def worker(self) -> str:
        """Its bus name."""
        return f"worker/{self.device}"

    def describe(self) -> str:
        """``component 'trainer' lost worker 'worker/2' on device 2 (pid 4242, killed by
        SIGKILL)``."""
        who = f"component {self.component!r}" if self.component else "the job"
        pid = f"pid {self.pid}, " if self.pid else ""
        return f"{who} lost worker {self.worker!r} on device {self.device} ({pid}{self.cause})"

    def error(self, consequence: str, *, fatal: bool) -> WorkerLostError:
        """The error that reports this loss and its ``consequence``."""
        return WorkerLostError(
            f"{self.describe()}: {consequence}",
            component=self.component,
            device=self.device,
            cause=self.cause,
            fatal=fatal,
        )


def exit_cause(pid: int) -> str | None:
    """How process ``pid`` ended (``"killed by SIGKILL"``, ``"exited with status 3"``, or
    ``"exited"`` when it is not this process's child to read), None while it runs or when
    it cannot be told. Never reaps it."""
    if pid <= 0:
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # not our child (torchrun's), or reaped already
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except PermissionError:
            return None
        return None
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return f"exited with status {info.si_status}"
    try:
        name = signal.Signals(info.si_status).name
    except ValueError:
        name = f"signal {info.si_status}"
    return f"killed by {name}"


@dataclass(frozen=True, slots=True)
class Registration:
    """One worker process as it registered."""

    pid: int
    """Its process id."""
    local: bool
    """Whether it runs on this host (then :func:`exit_cause` can probe it)."""
    kills: int
    """Kills the fault injector had fired at its device before it registered."""


class Losses:
    """What the controller knows of its workers' deaths (see the module docstring)."""

    def __init__(self) -> None:
        self._host = socket.gethostname()
        self._workers: dict[int, Registration] = {}
        self._suspects: dict[int, str] = {}
        self._ignored: set[int] = set()
        self.lost: dict[int, WorkerLoss] = {}
        """Confirmed losses by device (until a new worker registers there)."""
        self.reclaimed: set[int] = set()
        """Devices the job gave up after their worker died."""
        self._gone: dict[int, asyncio.Future[WorkerLoss]] = {}
        self._failure: tuple[WorkerLoss, str] | None = None
        self._failed: asyncio.Future[None] | None = None
        self.changed = asyncio.Event()
        """Set when a suspect is named or a round is asked for (the controller's tick
        wakes)."""
        self._judge: Callable[[], None] | None = None
        self._asked = 0
        self._settled = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    # ------------------------------------------------------------------ registrations

    def registered(self, device: int, *, pid: int, host: str, kills: int) -> None:
        """A (new) worker process registered for ``device``: what was known of the
        previous one no longer applies."""
        self._workers[device] = Registration(pid=pid, local=host == self._host, kills=kills)
        self._suspects.pop(device, None)
        self._ignored.discard(device)
        self.lost.pop(device, None)
        self._gone.pop(device, None)

    def registration(self, device: int) -> Registration | None:
        """How ``device``'s latest worker registered (None: never)."""
        return self._workers.get(device)

    # ------------------------------------------------------------------ suspicions

    def suspect(self, *devices: int, cause: str = "") -> None:
        """Name ``devices``' workers as possibly dead (``cause``: what was seen); the
        controller judges them on its next turn."""
        for device in devices:
            if device in self.lost or device in self._ignored or device not in self._workers:
                continue
            if cause or device not in self._suspects:
                self._suspects[device] = cause
            self.changed.set()

    def candidates(self) -> dict[int, str]:
        """Every suspect, and every local worker whose process ended, by device, each
        with what was seen (the suspects are cleared: each is judged once)."""
        found, self._suspects = self._suspects, {}
        for device, worker in self._workers.items():
            if device in self.lost or device in self._ignored or not worker.local:
                continue
            cause = exit_cause(worker.pid)
            if cause is not None:
                found[device] = cause
        return found

    def bind(self, judge: Callable[[], None]) -> None:
        """``judge()`` judges every suspect at once (the controller's ``LossHandler``)."""
        self._judge = judge

    def judge_now(self) -> None:
        """Have every suspect judged now, before the caller goes on (no-op unbound)."""
        if self._judge is not None:
            self._judge()

    def ignore(self, device: int) -> None:
        """Judge ``device``'s worker no more, until a new one registers there (a death
        that is not the controller's to handle)."""
        self._ignored.add(device)

    # ------------------------------------------------------------------ losses

    def lose(self, loss: WorkerLoss) -> None:
        """Record ``loss``: requests to that worker fail at once from now on."""
        self.lost[loss.device] = loss
        self._suspects.pop(loss.device, None)
        gone = self._gone.get(loss.device)
        if gone is not None and not gone.done():
            gone.set_result(loss)

    def is_lost(self, device: int) -> bool:
        """Whether ``device``'s worker is known to be dead."""
        return device in self.lost

    async def unless_lost(self, device: int, work: Awaitable[T]) -> T:
        """``work`` (a request to ``device``'s worker), unless that worker is lost first.

        Raises PeerLostError (``work`` cancelled) when it is, or was already.
        """
        name = f"worker/{device}"
        if device in self.lost:
            _discard(work)
            raise PeerLostError(name, f"{name} was lost ({self.lost[device].cause})")
        gone = self._gone.get(device)
        if gone is None:
            gone = self._gone[device] = asyncio.get_running_loop().create_future()

        def lost() -> BaseException:
            return PeerLostError(name, f"{name} was lost ({gone.result().cause})")

        return await _unless(work, gone, lost)

    # ------------------------------------------------------------------ the job's end

    def fail(self, loss: WorkerLoss, consequence: str) -> None:
        """The job cannot go on after ``loss``: record its one error (the first only)."""
        if self._failure is not None:
            return
        self._failure = (loss, consequence)
        if self._failed is not None and not self._failed.done():
            self._failed.set_result(None)

    def failure(self) -> WorkerLostError | None:
        """The job's fatal error (a new instance each time), or None while it goes on."""
        if self._failure is None:
            return None
        loss, consequence = self._failure
        return loss.error(consequence, fatal=True)

    def raise_if_failed(self) -> None:
        """Raise the job's fatal error, if any."""
        error = self.failure()
        if error is not None:
            raise error

    async def unless_failed(self, work: Awaitable[T]) -> T:
        """``work``, unless the job fails first; raises the fatal WorkerLostError then."""
        failed = self._failed
        if failed is None:
            failed = self._failed = asyncio.get_running_loop().create_future()
            if self._failure is not None:
                failed.set_result(None)

        def error() -> BaseException:
            fatal = self.failure()
            assert fatal is not None
            return fatal

        return await _unless(work, failed, error)

    # ------------------------------------------------------------------ settling

    def ask(self) -> int:
        """Ask for a round (judge, then reclaim) on the controller's next turn; its
        number."""
        self._asked += 1
        self.changed.set()
        return self._asked

    def begin(self) -> int:
        """A round starts: it answers every round asked for so far (pass the number to
        :meth:`settle` when it ends)."""
        return self._asked

    def settle(self, answered: int) -> None:
        """The round that began with ``answered`` ended: wake who waits for it."""
        self._settled = max(self._settled, answered)
        waiting, self._waiters = self._waiters, []
        for asked, future in waiting:
            if asked > self._settled:
                self._waiters.append((asked, future))
            elif not future.done():
                future.set_result(None)

    async def settled(self, asked: int) -> None:
        """Return once a round that began after round ``asked`` was asked for ended."""
        if self._settled >= asked:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((asked, future))
        await future


class GuardedChannels:
    """A channel backend that raises the job's fatal error rather than wait on
    (``ChannelBackend`` over another one; its ``timeout`` parameters are the protocol's)."""

    def __init__(self, inner: ChannelBackend, losses: Losses) -> None:
        self._inner, self._losses = inner, losses

    async def channel_put(
        self,
        channel: str,
        key: str,
        item: Sample | GenerationRequest,
        *,
        capacity: int,
        timeout: float | None,  # noqa: ASYNC109
    ) -> None:
        """As the inner backend's; raises the fatal WorkerLostError once the job failed."""
        put = self._inner.channel_put(channel, key, item, capacity=capacity, timeout=timeout)
        await self._losses.unless_failed(put)

    async def channel_get(
        self,
        channel: str,
        key: str,
        *,
        capacity: int,
        timeout: float | None,  # noqa: ASYNC109
    ) -> Sample | GenerationRequest:
        """As the inner backend's; raises the fatal WorkerLostError once the job failed."""
        get = self._inner.channel_get(channel, key, capacity=capacity, timeout=timeout)
        return await self._losses.unless_failed(get)


async def _unless(
    work: Awaitable[T], signal: asyncio.Future[Any], error: Callable[[], BaseException]
) -> T:
    """``work``'s result, unless ``signal`` resolves first: ``work`` is then cancelled and
    ``error()`` raised."""
    if signal.done():
        _discard(work)
        raise error()
    task = asyncio.ensure_future(work)
    task.add_done_callback(_retrieve)
    try:
        await asyncio.wait((task, signal), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait((task,))  # it ends before its caller does
        raise
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))
    if not task.cancelled() and (task.exception() is None or not signal.done()):
        return task.result()
    raise error()


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a raced task's exception as seen (its caller raised another one)."""
    if not task.cancelled():
        task.exception()


def _discard(work: Awaitable[Any]) -> None:
    """Close a coroutine that will not be awaited (no 'never awaited' warning)."""
    if inspect.iscoroutine(work):
        work.close()
