"""The soak helpers see memory growth, and every descriptor, socket, process and process
group a loop leaves behind; a clean loop leaves nothing."""

from __future__ import annotations

import mmap
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from soak_support import ResourceProbe, ResourceSample, leaks, memory_growth_per_min, soak

from dynarl.runtime import Journal
from dynarl.types import Allocation


def sample(t: float, rss: int) -> ResourceSample:
    return ResourceSample(
        time=t, rss={1: rss}, num_fds=0, num_sockets=0, pids=frozenset({1}), pgids=frozenset()
    )


def test_growth_is_the_least_squares_slope_after_the_warm_up() -> None:
    samples = [sample(0.0, 50_000_000)] + [sample(t, 1000 + 60 * int(t)) for t in range(1, 11)]
    assert memory_growth_per_min(samples, warmup_s=1.0) == pytest.approx(3600.0)
    with pytest.raises(ValueError, match="two samples"):
        memory_growth_per_min(samples, warmup_s=100.0)


def test_memory_fds_sockets_processes_and_groups_are_seen(tmp_path: Path) -> None:
    probe = ResourceProbe()
    baseline = probe.sample()
    # Fresh pages from the kernel: malloc may hand back memory an earlier test freed,
    # already resident, and then RSS does not move.
    ballast = mmap.mmap(-1, 64 * 1024 * 1024)
    for offset in range(0, len(ballast), mmap.PAGESIZE):  # touch every page
        ballast[offset] = 1
    grown = probe.sample()
    assert grown.total_rss - baseline.total_rss > 32 * 1024 * 1024
    ballast.close()
    file = (tmp_path / "f").open("w")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        found = leaks(baseline, probe.sample())
        assert any("file descriptors" in p for p in found), found
        assert any("sockets" in p for p in found), found
        assert f"processes [{child.pid}] still running" in found
        assert f"process groups [{child.pid}] still exist" in found
    finally:
        file.close()
        sock.close()
        child.kill()
        child.wait(timeout=10)
    assert leaks(baseline, probe.sample()) == []


def test_a_clean_loop_soaks_clean(tmp_path: Path) -> None:
    context = zmq.Context()
    context.socket(zmq.PAIR).close(linger=0)  # ZeroMQ starts its I/O thread on first use
    journal = Journal(tmp_path / "journal")
    iterations = []

    def body(iteration: int) -> None:
        iterations.append(time.monotonic())
        journal.commit(Allocation.of({"trainer": [iteration % 4]}))
        pair = [context.socket(zmq.PAIR) for _ in range(2)]
        pair[0].bind(f"inproc://soak-{iteration}")
        pair[1].connect(f"inproc://soak-{iteration}")
        pair[1].send(b"x")
        assert pair[0].recv() == b"x"
        for end in pair:
            end.close(linger=0)
        if iteration % 20 == 0:
            subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)

    try:
        report = soak(body, duration_s=2.0, sample_every_s=0.5, warmup_s=0.5)
    finally:
        journal.close()
        context.term()
    assert report.iterations == len(iterations) > 1 and report.leaks == ()
    assert len(report.samples) >= 3
