"""ServerProcess, the process handling both engine launchers share: the server's whole
process group stops with it, and a server whose parent dies is told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from dynarl.backends import _server_process
from dynarl.backends._server_process import ManagedServer, ServerProcess, free_port
from dynarl.errors import BackendError

WAIT_S = 60.0

_SERVER_WITH_A_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""

_PARENT = """
import asyncio, sys, time
from dynarl.backends._server_process import ServerProcess

async def main():
    server = ServerProcess("Stub", log_path=sys.argv[2])
    await server.start([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(str(server.pid))
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for_file(path: Path) -> int:
    deadline = time.monotonic() + WAIT_S
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.02)
    return int(path.read_text())


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gone(pid)


def test_close_stops_the_servers_children_too(tmp_path: Path) -> None:
    child_file = tmp_path / "child"

    async def main() -> tuple[int, int]:
        server = ServerProcess("Stub", log_path=str(tmp_path / "log"))
        await server.start([sys.executable, "-c", _SERVER_WITH_A_CHILD, str(child_file)])
        try:
            child = await asyncio.to_thread(_wait_for_file, child_file)
            assert server.pid is not None and os.getpgid(child) == server.pid
            return server.pid, child
        finally:
            await server.aclose()

    pid, child = asyncio.run(main())
    assert _wait_gone(pid) and _wait_gone(child)


def test_a_server_whose_parent_dies_is_stopped(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(pid_file), str(tmp_path / "log")],
        env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    server = None
    try:
        server = _wait_for_file(pid_file)
        parent.kill()
        parent.wait()
        assert _wait_gone(server), "the server outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if server is not None and not _gone(server):
            os.killpg(server, signal.SIGKILL)


def test_it_refuses_to_start_twice_and_reports_what_cannot_run(tmp_path: Path) -> None:
    async def main() -> None:
        server = ServerProcess("Stub", log_path=str(tmp_path / "log"))
        with pytest.raises(BackendError, match="Stub server could not be started"):
            await server.start([str(tmp_path / "no-such-binary")])
        await server.start([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            with pytest.raises(RuntimeError, match="already started"):
                await server.start([sys.executable])
        finally:
            await server.aclose()
        assert server.pid is None

    asyncio.run(main())


def test_it_says_how_a_server_ended_on_its_own(tmp_path: Path) -> None:
    async def ended(argv: list[str], *, kill: bool) -> list[str | None]:
        server = ServerProcess("Stub", log_path=str(tmp_path / "log"))
        await server.start(argv)
        seen = [server.exit_cause]
        assert server.pid is not None
        if kill:
            os.killpg(server.pid, signal.SIGKILL)
        for _ in range(int(WAIT_S / 0.02)):  # bounded polling, as the role polls it
            if server.exit_cause is not None:
                break
            await asyncio.sleep(0.02)
        seen.append(server.exit_cause)
        await server.aclose()
        return [*seen, server.exit_cause]

    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    failing = [sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(7)"]
    assert asyncio.run(ended(sleeper, kill=True)) == [None, "killed by SIGKILL", None]
    assert asyncio.run(ended(failing, kill=False)) == [None, "exited with status 7", None]


_LISTENER = """
import socket, sys, time
sock = socket.socket()
sock.bind(("127.0.0.1", int(sys.argv[1])))  # fails with EADDRINUSE when the port is taken
sock.listen()
print("listening", flush=True)
time.sleep(600)
"""


@dataclass(frozen=True)
class _Settings:
    port: int | None = None
    host: str = "127.0.0.1"
    startup_timeout_s: float = WAIT_S
    health_poll_s: float = 0.05
    stop_timeout_s: float = 5.0
    cpus: tuple[int, ...] = ()


class _Listener(ManagedServer):
    """A server that only binds its port: healthy once it says it listens."""

    engine = "Listener"

    def __init__(self, settings: _Settings, log: Path) -> None:
        super().__init__(settings)
        self._log = log

    def _command(self, port: int) -> list[str]:
        return [sys.executable, "-c", _LISTENER, str(port)]

    def _env(self) -> dict[str, str]:
        return {}

    def _log_file(self, port: int) -> str:
        return str(self._log)

    @contextlib.asynccontextmanager
    async def _probe(self) -> AsyncIterator[SimpleNamespace]:
        async def health() -> bool:  # the log, not the port: another socket may hold it
            return self._log.exists() and "listening" in self._log.read_text()

        yield SimpleNamespace(health=health)


def test_a_port_taken_before_the_server_binds_it_is_replaced_by_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy])
        monkeypatch.setattr(
            _server_process, "free_port", lambda host: next(picks, None) or free_port(host)
        )

        async def main() -> int | None:
            async with _Listener(_Settings(), tmp_path / "log") as server:
                return server.port

        port = asyncio.run(main())
        assert port is not None and port != busy
        assert "already in use" in (tmp_path / "log").read_text()

        async def named() -> None:
            async with _Listener(_Settings(port=busy), tmp_path / "named.log"):
                pass

        with pytest.raises(BackendError, match="Address already in use"):
            asyncio.run(named())
