"""LocalLauncher: worker processes on this machine, each stopped by its pid.

``spawn`` starts ``python -m dynarl.runtime.worker`` with a worker's options (its output
goes to ``<log_dir>/worker-<device>.log`` when a log directory is given); ``start`` does it
for several, as a :class:`~dynarl.runtime.launch.WorkerLauncher` (the controller it serves
binds on loopback and hosts its own store). ``stop`` ends
every process the launcher started: SIGTERM, a bounded wait, then SIGKILL; closing the
launcher (leaving its ``async with`` block, on error as well) does it too, and workers
are started only while it is open. ``kill`` is the fault-injection seam
(SIGKILL one worker). Waiting never blocks the event loop (the exit status is polled).
Runs on the controller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import IO, TYPE_CHECKING

from dynarl._resource import AsyncResource
from dynarl.bus import CurveServer
from dynarl.errors import WorkerError
from dynarl.runtime.worker import WorkerOptions

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["LocalLauncher"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05


class LocalLauncher(AsyncResource):
    """Spawns worker processes and stops exactly those (see the module docstring)."""

    def __init__(
        self,
        *,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        stop_timeout_s: float = 10.0,
    ) -> None:
        if stop_timeout_s <= 0:
            raise ValueError(f"stop_timeout_s must be > 0, got {stop_timeout_s}")
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.stop_timeout_s = stop_timeout_s
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._logs: dict[int, IO[bytes]] = {}
        self._spawning = False

    async def _open(self, stack: AsyncExitStack) -> None:
        self._spawning = True
        stack.push_async_callback(self._close)

    async def _close(self) -> None:
        self._spawning = False
        await self.stop()

    async def aclose(self) -> None:
        """Stop every worker started here (as :meth:`stop`); no more can be started
        (idempotent)."""
        await super().aclose()

    @property
    def store(self) -> Store | None:
        """None: the controller hosts the job's store on loopback."""
        return None

    @property
    def bind(self) -> str:
        """The controller's bus binds a free loopback port."""
        return "tcp://127.0.0.1:0"

    @property
    def curve(self) -> CurveServer | None:
        """None: a loopback bus needs no CURVE."""
        return None

    async def start(self, workers: Sequence[WorkerOptions]) -> None:
        """:meth:`spawn` each worker (raises as it does)."""
        for options in workers:
            self.spawn(options)

    def check(self) -> None:
        """Raise WorkerError naming the first worker started here that has exited (and
        its log, when there is one)."""
        for device in sorted(self._procs):
            code = self._procs[device].poll()
            if code is not None:
                log = f" (see {self.log_dir / f'worker-{device}.log'})" if self.log_dir else ""
                raise WorkerError(f"worker {device} exited with status {code}{log}")

    def exited(self) -> tuple[int, ...]:
        """Devices whose worker, started here, has exited."""
        return tuple(d for d, p in sorted(self._procs.items()) if p.poll() is not None)

    def spawn(self, options: WorkerOptions) -> int:
        """Start the worker of ``options.device``; returns its pid.

        Raises WorkerError if a live worker of that device was already started here, or
        if the launcher is not open.
        """
        if not self._spawning:
            raise WorkerError("the launcher is not open: use `async with LocalLauncher(...)`")
        device = options.device
        old = self._procs.get(device)
        if old is not None and old.poll() is None:
            raise WorkerError(f"worker {device} is already running (pid {old.pid})")
        command = self.command(options)
        out: IO[bytes] | int = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            if (previous := self._logs.pop(device, None)) is not None:
                previous.close()  # a worker started again: its log continues
            out = self._logs[device] = (self.log_dir / f"worker-{device}.log").open("ab")
        proc = subprocess.Popen(command, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self._procs[device] = proc
        logger.info("launched worker %d (pid %d)", device, proc.pid)
        return proc.pid

    def command(self, options: WorkerOptions) -> list[str]:
        """The command line of ``options.device``'s worker (a subclass may wrap it, e.g. to
        run it on another host or in another network namespace)."""
        return [self.python, "-m", "dynarl.runtime.worker", *options.to_args()]

    def pids(self) -> dict[int, int]:
        """``{device: pid}`` of the workers started here that are still running."""
        return {d: p.pid for d, p in self._procs.items() if p.poll() is None}

    def returncode(self, device: int) -> int | None:
        """Exit status of ``device``'s worker (None while it runs or if never started)."""
        proc = self._procs.get(device)
        return None if proc is None else proc.poll()

    def kill(self, device: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to ``device``'s worker (fault injection; SIGKILL returns once it is
        dead); no-op if it is gone."""
        proc = self._procs.get(device)
        if proc is not None and proc.poll() is None:
            logger.warning("sending signal %d to worker %d (pid %d)", sig, device, proc.pid)
            proc.send_signal(sig)
            if sig == signal.SIGKILL:  # gone when this returns: no race with a respawn
                proc.wait(timeout=self.stop_timeout_s)

    async def wait(self, device: int, *, within_s: float) -> int:
        """Wait up to ``within_s`` seconds for ``device``'s worker to exit; its status.

        Raises TimeoutError if it still runs then, WorkerError if no such worker was
        started here.
        """
        proc = self._procs.get(device)
        if proc is None:
            raise WorkerError(f"no worker {device} was started here")
        if not await _exited([proc], within_s):
            raise TimeoutError(f"worker {device} still running after {within_s} s")
        code = proc.poll()
        assert code is not None
        return code

    async def stop(self) -> None:
        """Terminate every worker started here, kill those that outlive the timeout (or
        every one still running, if the wait is cancelled)."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        try:
            await _exited(list(self._procs.values()), self.stop_timeout_s)
        finally:
            self._kill_all()

    def _kill_all(self) -> None:
        for device, proc in self._procs.items():
            if proc.poll() is None:
                logger.warning("worker %d (pid %d) still running: killing it", device, proc.pid)
                proc.kill()
                proc.wait(timeout=self.stop_timeout_s)
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        self._procs.clear()


async def _exited(procs: list[subprocess.Popen[bytes]], within_s: float) -> bool:
    """Whether every process exits within ``within_s`` seconds (polled, loop-friendly)."""
    deadline = time.monotonic() + within_s
    for _ in range(math.ceil(within_s / _POLL_S) + 1):
        if all(p.poll() is not None for p in procs):
            return True
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(_POLL_S)
    return all(p.poll() is not None for p in procs)
