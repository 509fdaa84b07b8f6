"""Start and stop an SGLang server process (``python -m sglang.launch_server ...``).

:func:`launch_command` builds the command line (pure). :class:`SGLangServer` starts it in a
new session (so its scheduler and detokenizer children share one process group), waits for
``/health`` to answer 200 before a deadline, and on ``aclose()`` stops the group it started:
SIGTERM, then SIGKILL after ``stop_timeout_s``. If the process exits or the deadline passes
during start-up, it is stopped and BackendError carries the tail of its log. Runs on the
caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass

from dynarl.backends.sglang._client import ClientConfig, SGLangClient
from dynarl.errors import BackendError

__all__ = ["SGLangServer", "SGLangServerConfig", "free_port", "launch_command"]

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True, kw_only=True, slots=True)
class SGLangServerConfig:
    """An SGLang server to launch (a subset of ``launch_server`` flags plus ``extra_args``)."""

    model_path: str
    """``--model-path``."""
    host: str = "127.0.0.1"
    """``--host``."""
    port: int = 0
    """``--port``; 0 picks a free one."""
    tp_size: int = 1
    """``--tp-size``."""
    enable_memory_saver: bool = True
    """``--enable-memory-saver`` (needed to release memory)."""
    enable_priority_scheduling: bool = True
    """``--enable-priority-scheduling``."""
    schedule_low_priority_values_first: bool = False
    """``--schedule-low-priority-values-first``."""
    api_key: str | None = None
    """``--api-key``."""
    admin_api_key: str | None = None
    """``--admin-api-key``."""
    extra_args: tuple[str, ...] = ()
    """Further flags, passed as they are."""
    python: str = sys.executable
    """Interpreter that runs the module."""
    module: str = "sglang.launch_server"
    """Module run with ``-m`` (a stand-in server in tests)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment entries added to the current environment."""
    startup_timeout_s: float = 900.0
    """Deadline for ``/health`` to answer 200 (model loading can take minutes)."""
    health_poll_s: float = 0.5
    """Pause between health probes."""
    stop_timeout_s: float = 30.0
    """Grace period between SIGTERM and SIGKILL."""
    log_path: str | None = None
    """File for the server's stdout and stderr; a temporary file if None."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        for name in ("startup_timeout_s", "health_poll_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def launch_command(config: SGLangServerConfig, port: int) -> list[str]:
    """The argv that starts ``config``'s server on ``port``."""
    argv = [
        config.python,
        "-m",
        config.module,
        "--model-path",
        config.model_path,
        "--host",
        config.host,
        "--port",
        str(port),
        "--tp-size",
        str(config.tp_size),
    ]
    if config.enable_memory_saver:
        argv.append("--enable-memory-saver")
    if config.enable_priority_scheduling:
        argv.append("--enable-priority-scheduling")
    if config.schedule_low_priority_values_first:
        argv.append("--schedule-low-priority-values-first")
    if config.api_key:
        argv += ["--api-key", config.api_key]
    if config.admin_api_key:
        argv += ["--admin-api-key", config.admin_api_key]
    return argv + list(config.extra_args)


class SGLangServer:
    """A server process this object started and will stop; ``async with SGLangServer(cfg)``."""

    def __init__(self, config: SGLangServerConfig) -> None:
        self.config = config
        self.port = config.port
        self._process: asyncio.subprocess.Process | None = None
        self._log_path = config.log_path
        self._owns_log = config.log_path is None

    @property
    def url(self) -> str:
        """``http://host:port`` of the server."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id (and process-group id) of the server, while it runs."""
        return self._process.pid if self._process is not None else None

    def client_config(self) -> ClientConfig:
        """A :class:`ClientConfig` for this server, with its keys."""
        return ClientConfig(
            base_url=self.url, api_key=self.config.api_key, admin_api_key=self.config.admin_api_key
        )

    async def __aenter__(self) -> SGLangServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the process and wait until ``/health`` answers 200.

        Raises BackendError (with the log tail) if it exits or misses the deadline; the
        process is stopped first.
        """
        if self._process is not None:
            raise RuntimeError("server already started")
        self.port = self.config.port or free_port(self.config.host)
        if self._log_path is None:
            handle, self._log_path = tempfile.mkstemp(prefix="sglang-", suffix=".log")
            os.close(handle)
        argv = launch_command(self.config, self.port)
        log = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **dict(self.config.env)},
            )
        finally:
            os.close(log)
        logger.info("started SGLang server pid %d on %s", self._process.pid, self.url)
        try:
            await self._wait_healthy()
        except BaseException:
            await self.aclose()
            raise

    async def _wait_healthy(self) -> None:
        assert self._process is not None
        client = SGLangClient(
            ClientConfig(base_url=self.url, num_attempts=1, timeout_s=5.0, connect_timeout_s=1.0)
        )
        try:
            async with asyncio.timeout(self.config.startup_timeout_s):
                while True:
                    if self._process.returncode is not None:
                        raise BackendError(
                            f"SGLang server exited with {self._process.returncode} during "
                            f"start-up; log tail:\n{self.log_tail()}"
                        )
                    with contextlib.suppress(BackendError):
                        if await client.health():
                            return
                    await asyncio.sleep(self.config.health_poll_s)
        except TimeoutError as exc:
            raise BackendError(
                f"SGLang server not healthy after {self.config.startup_timeout_s} s; "
                f"log tail:\n{self.log_tail()}"
            ) from exc
        finally:
            await client.aclose()

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
            self._signal(process.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(self.config.stop_timeout_s):
                    await process.wait()
            except TimeoutError:
                logger.warning("SGLang server pid %d ignored SIGTERM; killing", process.pid)
                self._signal(process.pid, signal.SIGKILL)
                await process.wait()
            logger.info("stopped SGLang server pid %d", process.pid)
        if process is not None:
            # Children left in the group of a leader that exited on its own. Linux does not
            # hand out a pid that is still some group's id, so this reaches only them.
            self._signal(process.pid, signal.SIGKILL)
        if self._owns_log and self._log_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._log_path)
            self._log_path = None

    @staticmethod
    def _signal(pgid: int, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)
