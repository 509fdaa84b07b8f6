"""The multi-host fixture (``tests/netns_support.py``): hosts reach each other over their
private network and nothing else, a cut link partitions a host until restored, teardown
leaves nothing behind (also after a failure), and a killed run's namespaces are swept."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from netns_support import (
    IFNAME,
    Host,
    Network,
    ip,
    namespaces,
    netns,  # noqa: F401 (the fixture)
    network,
    sweep,
    unavailable,
)
from psutil import pid_exists

pytestmark = [pytest.mark.dist, pytest.mark.netns]


PORT = 7000
LISTEN = f"""
import socket
server = socket.create_server(("0.0.0.0", {PORT}))
print("listening", flush=True)
while True:
    server.accept()[0].close()
"""
CONNECT = f"import socket, sys; socket.create_connection((sys.argv[1], {PORT}), timeout=1)"


def listen_everywhere(net: Network, tmp: Path) -> None:
    """A TCP listener on PORT in every host (stopped at teardown), once it listens."""
    logs = [tmp / f"listen{h.index}.log" for h in net.hosts]
    for host, log in zip(net.hosts, logs, strict=True):
        net.run(host, [sys.executable, "-c", LISTEN], log=log)
    deadline = time.monotonic() + 30
    while not all(log.exists() and "listening" in log.read_text() for log in logs):
        assert time.monotonic() < deadline, "the listeners did not start"
        time.sleep(0.05)


def reaches(src: Host, dst: Host) -> bool:
    """Whether a TCP connection from ``src`` to ``dst``'s listener opens within a second."""
    command = ["ip", "netns", "exec", src.namespace, sys.executable, "-c", CONNECT, dst.address]
    return subprocess.run(command, capture_output=True, check=False).returncode == 0


def wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def ours(net: Network) -> list[str]:
    return [name for name in namespaces() if net.run_id in name]


def test_hosts_reach_each_other_and_a_cut_link_partitions_one(
    netns: Callable[[int], Network],  # noqa: F811
    tmp_path: Path,
) -> None:
    net = netns(3)
    listen_everywhere(net, tmp_path)
    h0, h1, h2 = net.hosts
    assert [h.address for h in net.hosts] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    assert len({h.job_dir for h in net.hosts}) == 3 and all(h.job_dir.is_dir() for h in net.hosts)
    assert reaches(h0, h1) and reaches(h2, h0)
    # No default route: only the private /24 and loopback.
    assert "default" not in ip("-n", h0.namespace, "route")
    assert "UP" in ip("-n", h0.namespace, "-br", "link", "show", "lo")
    net.cut(h1)
    assert not reaches(h0, h1) and not reaches(h1, h2)
    assert reaches(h0, h2)  # the others still talk
    net.restore(h1)
    assert reaches(h0, h1)


def test_a_command_runs_inside_its_host_and_is_stopped_by_pid(
    netns: Callable[[int], Network],  # noqa: F811
    tmp_path: Path,
) -> None:
    net = netns(2)
    h0 = net.hosts[0]
    script = "import os, time; print(os.environ['GLOO_SOCKET_IFNAME'], flush=True); time.sleep(60)"
    log = tmp_path / "sleeper.log"
    process = net.run(h0, [sys.executable, "-c", script], log=log)
    deadline = time.monotonic() + 30
    while not log.read_text():
        assert time.monotonic() < deadline, "the command printed nothing"
        time.sleep(0.05)
    ip_in_ns = ip("netns", "pids", h0.namespace).split()
    assert str(process.pid) in ip_in_ns  # the command itself, in the namespace
    assert net.stop(process) != 0
    assert log.read_text().strip() == IFNAME


def test_teardown_removes_everything_after_a_failure(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    before = set(ip("-br", "link").split())
    with pytest.raises(RuntimeError, match="the test failed"), network(2, tmp_path) as net:
        sleeper = net.run(net.hosts[1], ["sleep", "60"], log=tmp_path / "s.log")
        assert len(ours(net)) == 3  # two hosts and the switch
        raise RuntimeError("the test failed")
    assert ours(net) == []
    assert sleeper.poll() is not None
    assert set(ip("-br", "link").split()) == before  # nothing was made outside


def test_a_killed_runs_namespaces_are_swept(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    # A run that dies before its teardown: its namespaces and its process stay behind.
    child = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
from pathlib import Path
from netns_support import network
with network(2, Path({str(tmp_path)!r})) as net:
    net.run(net.hosts[0], ["sleep", "300"], log=Path({str(tmp_path / "left.log")!r}))
    print(net.run_id, flush=True)
    time.sleep(300)
"""
    run = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None
        run_id = run.stdout.readline().strip()
        assert run_id, "the run did not start"
        run.kill()
        run.wait(timeout=30)
        left = [name for name in namespaces() if run_id in name]
        assert len(left) == 3
        (sleeper,) = map(int, ip("netns", "pids", f"dynarl-{run_id}-h0").split())
        assert sorted(sweep()) == sorted(left)
        assert not [name for name in namespaces() if run_id in name]
        assert wait_gone(sleeper)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=30)
        if run.stdout is not None:
            run.stdout.close()
        sweep()
