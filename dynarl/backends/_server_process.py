"""An engine server process that dynarl started and will stop (SGLang, vLLM).

:class:`ServerProcess` starts a command in a new session, so the server and every process
it spawns share one process group, with its stdout and stderr in a log file. On Linux the
server also gets a parent-death signal (``prctl(PR_SET_PDEATHSIG)``): when the thread that
started it ends — the worker was killed, say — the kernel sends the server SIGTERM and it
shuts its own children down. :meth:`ServerProcess.wait_healthy` polls a health probe until
it answers or a deadline passes; :meth:`ServerProcess.aclose` stops the whole group: SIGTERM,
then SIGKILL after a grace period. A server that exits or misses the deadline during
start-up raises :class:`~dynarl.errors.BackendError` naming the engine, with the tail of its
log. Runs on the caller's event loop; start it from a thread that lives as long as the
server should (the signal follows the thread, not the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence

from dynarl.errors import BackendError

__all__ = ["ServerProcess", "free_port"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _parent_death_signal(signum: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks the kernel to send ``signum`` to the child when its parent
    thread ends; None where there is no ``prctl``."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signum))
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signum)

    return preexec


class ServerProcess:
    """One server process group: ``await start(argv)``, ``await wait_healthy(probe)``,
    ``await aclose()``.

    ``log_path`` None writes the log to a temporary file removed on close.
    """

    def __init__(
        self, engine: str, *, log_path: str | None = None, stop_timeout_s: float = 30.0
    ) -> None:
        if stop_timeout_s <= 0:
            raise ValueError(f"stop_timeout_s must be > 0, got {stop_timeout_s}")
        self.engine = engine
        self.stop_timeout_s = stop_timeout_s
        self._log_path = log_path
        self._owns_log = log_path is None
        self._process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        """Process id (and process-group id) of the server, while it runs."""
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> str | None:
        """The server's log file (None once a temporary one is removed)."""
        return self._log_path

    async def start(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        """Start ``argv`` with ``env`` added to this process's environment.

        Raises RuntimeError if already started, BackendError if it cannot be executed.
        """
        if self._process is not None:
            raise RuntimeError(f"{self.engine} server already started")
        if self._log_path is None:
            handle, self._log_path = tempfile.mkstemp(
                prefix=f"{self.engine.lower()}-", suffix=".log"
            )
            os.close(handle)
        log = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_parent_death_signal(signal.SIGTERM),
                env={**os.environ, **(env or {})},
            )
        except OSError as exc:
            raise BackendError(f"{self.engine} server could not be started: {exc}") from exc
        finally:
            os.close(log)
        logger.info("started %s server pid %d: %s", self.engine, self._process.pid, argv[:3])

    async def wait_healthy(
        self, probe: Callable[[], Awaitable[bool]], *, timeout_s: float, poll_s: float
    ) -> None:
        """Poll ``probe`` until it returns True; BackendError raised by it counts as not yet.

        Raises BackendError (with the log tail) if the process exits or ``timeout_s``
        passes first; the caller stops it.
        """
        process = self._process
        if process is None:
            raise RuntimeError(f"{self.engine} server not started")
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    if process.returncode is not None:
                        raise BackendError(
                            f"{self.engine} server exited with {process.returncode} during "
                            f"start-up; log tail:\n{self.log_tail()}"
                        )
                    with contextlib.suppress(BackendError):
                        if await probe():
                            return
                    await asyncio.sleep(poll_s)
        except TimeoutError as exc:
            raise BackendError(
                f"{self.engine} server not healthy after {timeout_s} s; "
                f"log tail:\n{self.log_tail()}"
            ) from exc

    def log_tail(self, num_bytes: int = 4000) -> str:
        """The end of the server's log."""
        if self._log_path is None or not os.path.exists(self._log_path):
            return ""
        with open(self._log_path, "rb") as log:
            log.seek(max(os.path.getsize(self._log_path) - num_bytes, 0))
            return log.read().decode(errors="replace")

    async def aclose(self) -> None:
        """Stop the process group this object started: SIGTERM, then SIGKILL; idempotent."""
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(self.stop_timeout_s):
                    await process.wait()
            except TimeoutError:
                logger.warning(
                    "%s server pid %d ignored SIGTERM; killing", self.engine, process.pid
                )
                _signal_group(process.pid, signal.SIGKILL)
                await process.wait()
            logger.info("stopped %s server pid %d", self.engine, process.pid)
        if process is not None:
            # Children left in the group of a leader that exited on its own. Linux does not
            # hand out a pid that is still some group's id, so this reaches only them.
            _signal_group(process.pid, signal.SIGKILL)
        if self._owns_log and self._log_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._log_path)
            self._log_path = None


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
