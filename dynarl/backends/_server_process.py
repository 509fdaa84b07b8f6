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

:class:`ManagedServer` is what an engine's launcher (``SGLangServer``, ``VLLMServer``) adds
around it: a port, the URL, ``async with``, start-then-wait-for-health, stop. A launcher
says only its command, environment, log file and health probe.
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
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, Self

from dynarl.errors import BackendError

__all__ = ["ManagedServer", "ServerProcess", "ServerSettings", "free_port"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


_PORT_ATTEMPTS = 3


def _port_taken(error: str) -> bool:
    """Whether a start-up error's log tail says the server could not bind its port."""
    return "address already in use" in error.lower()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _preexec(signum: signal.Signals, cpus: Sequence[int]) -> Callable[[], None] | None:
    """A ``preexec_fn`` that pins the child to ``cpus`` (if any) and asks the kernel to send
    ``signum`` to it when its parent thread ends; None off Linux (no ``prctl``, no
    affinity)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    parent = os.getpid()

    def preexec() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
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

    @property
    def exit_cause(self) -> str | None:
        """How the server ended on its own (``"killed by SIGKILL"``, ``"exited with status
        1"``); None while it runs, before it starts and after :meth:`aclose`."""
        process = self._process
        if process is None or process.returncode is None:
            return None
        return describe_exit(process.returncode)

    async def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        cpus: Sequence[int] = (),
    ) -> None:
        """Start ``argv`` with ``env`` added to this process's environment, on the cores
        ``cpus`` (inherited by everything it starts; empty: this process's).

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
                preexec_fn=_preexec(signal.SIGTERM, tuple(cpus)),
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
                            f"{self.engine} server {describe_exit(process.returncode)} during "
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


def describe_exit(returncode: int) -> str:
    """``"killed by SIGKILL"`` for -9, ``"exited with status 1"`` for 1."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


class ServerSettings(Protocol):
    """What :class:`ManagedServer` reads of an engine's server config."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int | None: ...
    @property
    def startup_timeout_s(self) -> float: ...
    @property
    def health_poll_s(self) -> float: ...
    @property
    def stop_timeout_s(self) -> float: ...
    @property
    def cpus(self) -> tuple[int, ...]: ...


class ManagedServer:
    """An engine server this object started and will stop; ``async with Server(config)``.

    Subclasses name the engine (``engine``) and give its command, environment, log file
    and a health probe.
    """

    engine = "engine"

    def __init__(self, config: ServerSettings) -> None:
        self._settings = config
        self.port = config.port
        self._process: ServerProcess | None = None

    def _command(self, port: int) -> Sequence[str]:
        raise NotImplementedError

    def _env(self) -> Mapping[str, str]:
        raise NotImplementedError

    def _log_file(self, port: int) -> str | None:
        raise NotImplementedError

    def _probe(self) -> AbstractAsyncContextManager[Any]:
        """A client of :attr:`url` with short deadlines, entered to poll ``health()``."""
        raise NotImplementedError

    @property
    def url(self) -> str:
        """``http://host:port`` of the server."""
        return f"http://{self._settings.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id (and process-group id) of the server, while it runs."""
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> str | None:
        """The server's log file, while it runs."""
        return self._process.log_path if self._process is not None else None

    @property
    def exit_cause(self) -> str | None:
        """How the server ended on its own, if it did (see :attr:`ServerProcess.exit_cause`)."""
        return self._process.exit_cause if self._process is not None else None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the server and wait until its health probe answers.

        A port this object picked that turns out taken is picked again (three tries in all).
        Raises BackendError naming the engine, with the log tail, if it exits or misses the
        deadline (it is stopped first); RuntimeError if already started.
        """
        if self._process is not None:
            raise RuntimeError(f"{self.engine} server already started")
        settings = self._settings
        # A port we picked can be taken between the pick and the server's bind (another
        # process's ephemeral port): pick again. A port the caller named is not retried.
        attempts = 1 if settings.port else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            try:
                await self._start_on(settings.port or free_port(settings.host))
                return
            except BackendError as exc:
                if attempt == attempts or not _port_taken(str(exc)):
                    raise
                logger.warning(
                    "%s server port %s was taken; picking another", self.engine, self.port
                )

    async def _start_on(self, port: int) -> None:
        settings = self._settings
        self.port = port
        self._process = ServerProcess(
            self.engine, log_path=self._log_file(port), stop_timeout_s=settings.stop_timeout_s
        )
        try:
            await self._process.start(self._command(port), self._env(), cpus=settings.cpus)
            async with self._probe() as probe:
                await self._process.wait_healthy(
                    probe.health,
                    timeout_s=settings.startup_timeout_s,
                    poll_s=settings.health_poll_s,
                )
        except BaseException:
            await self.aclose()
            raise

    def log_tail(self, num_bytes: int = 4000) -> str:
        """The end of the server's log."""
        return self._process.log_tail(num_bytes) if self._process is not None else ""

    async def aclose(self) -> None:
        """Stop the server's process group: SIGTERM, then SIGKILL; idempotent."""
        process, self._process = self._process, None
        if process is not None:
            await process.aclose()
