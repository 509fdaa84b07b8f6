"""Launching job files for the tests: under two torchruns on this machine (two "nodes" of
one rank each, c10d rendezvous on loopback, each torchrun its own process group) or as a
plain process (the local launcher), each logging to a file and stopped, with everything it
started, when it outlives the timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TESTS = ROOT / "tests"
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    path = [str(EXAMPLES), str(TESTS), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    return env


def start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        # Its own session, so that everything it starts can be stopped as one group.
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=environment(),
            start_new_session=True, cwd=ROOT,
        )  # fmt: skip


def finish(processes: list[subprocess.Popen[bytes]]) -> list[int]:
    """Their exit statuses; whatever still runs after the timeout is killed, by group."""
    try:
        return [p.wait(timeout=TIMEOUT_S) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


def torchrun(node: int, port: int, tmp: Path, job: str, args: list[str]) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "dynarl-job-test", "--rdzv-conf", f"is_host={int(node == 0)}",
        "--monitor-interval", "0.5",
        "-m", "dynarl.runtime.launch", "--job", job, "--job-dir", str(tmp / "job"),
        "--rendezvous-timeout", "120", "--", *args,
    ]  # fmt: skip
    return start(command, tmp / f"node{node}.log")


def two_nodes(tmp: Path, job: str, args: list[str]) -> tuple[list[int], str]:
    (tmp / "job").mkdir(parents=True)
    port = free_port()
    codes = finish([torchrun(0, port, tmp, job, args), torchrun(1, port, tmp, job, args)])
    logs = "\n".join((tmp / f"node{n}.log").read_text(errors="replace") for n in (0, 1))
    return codes, logs


def result_steps(run_dir: Path) -> list[dict[str, object]]:
    """The per-step records of a two-device job file's ``result.json`` in ``run_dir``."""
    result = json.loads((run_dir / "result.json").read_text())
    assert result["num_devices"] == 2
    return list(result["steps"])


def local_and_torchrun(
    tmp: Path, example: str, job: str, args: list[str]
) -> tuple[list[dict[str, object]], list[dict[str, object]], str]:
    """Run ``examples/<example>`` on the local launcher (first: it fills the job's cache),
    then ``job`` under two torchruns; both must exit 0. The local run's per-step records,
    the torchrun run's, and the torchrun logs."""
    local_log = tmp / "local.log"
    local = start([sys.executable, str(EXAMPLES / example), *args,
                   "--run-dir", str(tmp / "local")], local_log)  # fmt: skip
    assert finish([local]) == [0], local_log.read_text(errors="replace")[-6000:]
    codes, logs = two_nodes(tmp / "torchrun", job, args)
    assert codes == [0, 0], logs[-6000:]
    return result_steps(tmp / "local"), result_steps(tmp / "torchrun" / "job"), logs


def committed_reshards(job_dir: Path) -> list[tuple[list[int], list[int]]]:
    """(source devices, destination devices) of every committed P2P reshard in the job's
    ledger (``events.jsonl``), in order."""
    records = [json.loads(line) for line in (job_dir / "events.jsonl").read_text().splitlines()]
    return [
        (r["src_devices"], r["dst_devices"])
        for r in records
        if r["type"] == "MigrationRecord" and r["kind"] == "p2p" and r["outcome"] == "committed"
    ]
