"""Start and stop an SGLang server process (``python -m sglang.launch_server ...``).

:func:`launch_command` builds the command line (pure). :class:`SGLangServer` starts it as a
:class:`~dynarl.backends._server_process.ServerProcess` (its own process group, so its
scheduler and detokenizer children go with it, and a parent-death signal), waits for
``/health`` to answer 200 before a deadline, and on ``aclose()`` stops the group it started:
SIGTERM, then SIGKILL after ``stop_timeout_s``. If the process exits or the deadline passes
during start-up, it is stopped and BackendError carries the tail of its log. Runs on the
caller's event loop.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from dynarl.backends._server_process import ManagedServer, free_port
from dynarl.backends.sglang._client import ClientConfig, SGLangClient

__all__ = ["SGLangServer", "SGLangServerConfig", "free_port", "launch_command"]


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
    cpus: tuple[int, ...] = ()
    """Cores the server's processes run on (their affinity). Empty: the caller's cores."""
    startup_timeout_s: float = 900.0
    """Deadline for ``/health`` to answer 200 (model loading can take minutes)."""
    health_poll_s: float = 0.5
    """Pause between health probes."""
    stop_timeout_s: float = 30.0
    """Grace period between SIGTERM and SIGKILL."""
    log_path: str | None = None
    """File for the server's stdout and stderr (appended to; its directory is created); a
    temporary file if None."""

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


class SGLangServer(ManagedServer):
    """A server process this object started and will stop; ``async with SGLangServer(cfg)``."""

    engine = "SGLang"

    def __init__(self, config: SGLangServerConfig) -> None:
        super().__init__(config)
        self.config = config

    def client_config(self) -> ClientConfig:
        """A :class:`ClientConfig` for this server, with its keys."""
        return ClientConfig(
            base_url=self.url, api_key=self.config.api_key, admin_api_key=self.config.admin_api_key
        )

    def _command(self, port: int) -> list[str]:
        return launch_command(self.config, port)

    def _env(self) -> dict[str, str]:
        return dict(self.config.env)

    def _log_file(self, port: int) -> str | None:
        if self.config.log_path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(self.config.log_path)), exist_ok=True)
        return self.config.log_path

    def _probe(self) -> SGLangClient:
        return SGLangClient(
            ClientConfig(base_url=self.url, num_attempts=1, timeout_s=5.0, connect_timeout_s=1.0)
        )
