"""The example of the embedding API runs; the local launcher stops what it starts."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dynarl.runtime.launch._local import LocalLauncher
from dynarl.runtime.worker._options import WorkerOptions

pytestmark = pytest.mark.dist

ROOT = Path(__file__).parent.parent.parent


def test_the_custom_loop_example_runs_and_leaves_no_run_directory(tmp_path: Path) -> None:
    example = ROOT / "examples" / "custom_loop.py"
    done = subprocess.run(
        [sys.executable, str(example), "--iterations", "1", "--samples", "8"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []  # its temporary run directory is gone
    lines = done.stdout.splitlines()
    assert lines[0].startswith("job started: {'rollout': [0, 1], 'trainer': [2]}")
    assert "iteration 0:  8/8 samples" in done.stdout
    assert lines[-1].startswith("final allocation")


def test_the_launcher_stops_every_worker_it_started(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nobody listens on: registration never succeeds
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def main() -> None:
        async with LocalLauncher(log_dir=tmp_path, stop_timeout_s=5.0) as launcher:
            for device in (0, 1):
                options = WorkerOptions(
                    controller=f"tcp://127.0.0.1:{port}", device=device, register_timeout_s=60.0
                )
                launcher.spawn(options)
            assert set(launcher.pids()) == {0, 1}
            with pytest.raises(TimeoutError):
                await launcher.wait(0, within_s=0.2)
            launcher.kill(1)
            assert await launcher.wait(1, within_s=30.0) != 0
        assert launcher.pids() == {}
        assert launcher.returncode(0) is None  # forgotten once stopped

    asyncio.run(main())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0.log", "worker-1.log"]
