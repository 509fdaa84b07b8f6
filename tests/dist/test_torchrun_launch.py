"""Two "nodes" on this machine, each its own ``torchrun`` (c10d rendezvous on loopback),
launching ``dynarl.runtime.launch`` with CURVE forced: node 1's worker reaches node 0's
controller over an authenticated bus. A rank dies: the controller (rank 0) SIGKILLs itself
after step 2, or the worker of rank 1 (the other node) SIGKILLs itself during step 3;
torchrun (``--max-restarts``) restarts the ranks, and the new controller finds the
journal, restores the checkpoint and the sample cursor, redoes steps 2 on and ends where
an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import standin_job

from dynarl.bus import generate_keys
from dynarl.runtime.durable._journal import read_journal, recover
from dynarl.runtime.durable._journal_records import Restored

pytestmark = pytest.mark.dist

TESTS = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(node: int, port: int, tmp: Path, job_args: list[str]) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "dynarl-launch-test", "--rdzv-conf", f"is_host={int(node == 0)}",
        "--max-restarts", "2", "--monitor-interval", "0.5",
        "-m", "dynarl.runtime.launch", "--job", "standin_job:JOB", "--job-dir", str(tmp / "job"),
        "--curve", "--key-file", str(tmp / "keys" / f"node{node}.key_secret"),
        "--allowed-keys", str(tmp / "authorized"), "--rendezvous-timeout", "120",
        "--", *job_args,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    with (tmp / f"node{node}.log").open("wb") as log:
        # Its own session, so that everything it starts can be stopped as one group.
        return subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)


@pytest.mark.parametrize(
    "victim", [pytest.param("controller", marks=pytest.mark.slow), "worker"]
)  # the controller variant (~20 s) runs in make test-slow
def test_two_torchrun_nodes_over_curve_survive_a_dead_rank(tmp_path: Path, victim: str) -> None:
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    for node in (0, 1):
        public, _ = generate_keys(tmp_path / "keys", f"node{node}")
        shutil.copy(public, authorized / public.name)
    (tmp_path / "job").mkdir()
    job_args = ["--steps", "6", "--checkpoint-every", "2", "--kill-at", "2"]
    job_args += ["--kill-rank", "1" if victim == "worker" else "0"]
    port = free_port()
    nodes = [torchrun(0, port, tmp_path, job_args), torchrun(1, port, tmp_path, job_args)]
    try:
        codes = [node.wait(timeout=TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(timeout=30)
    logs = "\n".join((tmp_path / f"node{n}.log").read_text(errors="replace") for n in (0, 1))
    assert codes == [0, 0], logs[-6000:]
    assert (tmp_path / "job" / "killed").exists(), f"the {victim} was never killed"
    result = json.loads((tmp_path / "job" / "result.json").read_text())
    expected = standin_job.reference(standin_job.parse(job_args))
    assert result["resumed_from"] == 2 and result["violations"] == [], result
    # torchrun restarted the dead rank's node (its agent counts the restart) and node 0's
    # restarted controller resumed from the journal and the checkpoint.
    node = 0 if victim == "controller" else 1
    assert f"(node {node}, restart 1) starting" in logs
    assert result["restart_count"] >= (1 if victim == "controller" else 0)
    assert result["digests"] == expected["digests"][2:]
    assert result["checksum"] == expected["checksum"]
    assert result["workers"] == ["rank-0", "rank-1"]
    state = recover(tmp_path / "job" / "journal")
    assert state.steps_done == 6 and state.epoch == 1
    restores = [r for r in read_journal(tmp_path / "job" / "journal").records
                if isinstance(r, Restored)]  # fmt: skip
    assert [(r.steps_done, r.cursor) for r in restores] == [(2, 2 * 4)]
