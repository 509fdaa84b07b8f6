"""Soak-test helpers: resource samples of a process tree and what grew against a baseline.

A :class:`ResourceProbe` samples this process and its descendants (or any root pid):
resident memory per process, open file descriptors, sockets (inet and unix), the set of
processes and of process groups. :func:`memory_growth_per_min` fits a least-squares line to
total RSS after a warm-up, and :func:`leaks` names every count that did not come back to
its baseline. :func:`soak` runs a loop body for a duration with periodic samples and
returns a :class:`SoakReport`. Needs psutil (the ``dev`` extra).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil


@dataclass(frozen=True, kw_only=True, slots=True)
class ResourceSample:
    """One look at a process tree."""

    time: float
    """When, seconds (monotonic)."""
    rss: dict[int, int]
    """Resident bytes per pid."""
    num_fds: int
    """Open file descriptors, all processes together."""
    num_sockets: int
    """Open sockets (inet and unix), all processes together."""
    pids: frozenset[int]
    """Live processes (the root included)."""
    pgids: frozenset[int]
    """Their process groups."""

    @property
    def total_rss(self) -> int:
        """Resident bytes of the whole tree."""
        return sum(self.rss.values())


class ResourceProbe:
    """Samples ``pid`` (default: this process) and its live descendants."""

    def __init__(self, pid: int | None = None) -> None:
        self._root = psutil.Process(pid or os.getpid())

    def sample(self) -> ResourceSample:
        """Collect garbage here (when probing this process), then look."""
        if self._root.pid == os.getpid():
            gc.collect()
        rss: dict[int, int] = {}
        fds = sockets = 0
        pgids: set[int] = set()
        for process in [self._root, *self._root.children(recursive=True)]:
            try:
                if process.status() == psutil.STATUS_ZOMBIE:
                    continue
                with process.oneshot():
                    rss[process.pid] = process.memory_info().rss
                    fds += process.num_fds()
                    sockets += len(process.net_connections(kind="all"))
                pgids.add(os.getpgid(process.pid))
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue
        return ResourceSample(
            time=time.monotonic(), rss=rss, num_fds=fds, num_sockets=sockets,
            pids=frozenset(rss), pgids=frozenset(pgids),
        )  # fmt: skip


def memory_growth_per_min(samples: Sequence[ResourceSample], *, warmup_s: float = 0.0) -> float:
    """Least-squares slope of total RSS in bytes per minute, over the samples taken at
    least ``warmup_s`` after the first. Raises ValueError with fewer than two of them."""
    start = samples[0].time + warmup_s if samples else 0.0
    points = [(s.time, float(s.total_rss)) for s in samples if s.time >= start]
    if len(points) < 2:
        raise ValueError(f"need two samples after the warm-up, got {len(points)}")
    mean_t = sum(t for t, _ in points) / len(points)
    mean_m = sum(m for _, m in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        raise ValueError("the samples share one time")
    slope = sum((t - mean_t) * (m - mean_m) for t, m in points) / spread
    return slope * 60.0


def growth_by_process(
    samples: Sequence[ResourceSample], *, warmup_s: float = 0.0
) -> dict[int, float]:
    """:func:`memory_growth_per_min` of each process seen in every sample after the
    warm-up (bytes per minute, by pid): which process of the tree grows."""
    start = samples[0].time + warmup_s if samples else 0.0
    late = [s for s in samples if s.time >= start]
    pids = set.intersection(*(set(s.rss) for s in late)) if late else set()
    return {pid: memory_growth_per_min([_only(s, pid) for s in late]) for pid in sorted(pids)}


def _only(sample: ResourceSample, pid: int) -> ResourceSample:
    """``sample`` reduced to the memory of ``pid``."""
    return ResourceSample(
        time=sample.time, rss={pid: sample.rss[pid]}, num_fds=0, num_sockets=0,
        pids=frozenset({pid}), pgids=frozenset(),
    )  # fmt: skip


def leaks(baseline: ResourceSample, now: ResourceSample) -> list[str]:
    """What ``now`` holds beyond ``baseline``: file descriptors, sockets, processes,
    process groups (empty when everything came back)."""
    problems = []
    if now.num_fds > baseline.num_fds:
        problems.append(f"{now.num_fds - baseline.num_fds} more file descriptors")
    if now.num_sockets > baseline.num_sockets:
        problems.append(f"{now.num_sockets - baseline.num_sockets} more sockets")
    if extra := sorted(now.pids - baseline.pids):
        problems.append(f"processes {extra} still running")
    if extra := sorted(now.pgids - baseline.pgids):
        problems.append(f"process groups {extra} still exist")
    return problems


@dataclass(frozen=True, kw_only=True, slots=True)
class SoakReport:
    """What a soak loop left behind."""

    iterations: int
    """Loop bodies run."""
    growth_bytes_per_min: float
    """RSS slope after the warm-up."""
    leaks: tuple[str, ...]
    """Counts above the baseline after the loop (see :func:`leaks`)."""
    samples: tuple[ResourceSample, ...]
    """Every sample, baseline first."""


def soak(
    body: Callable[[int], None],
    *,
    duration_s: float,
    sample_every_s: float,
    warmup_s: float,
    probe: ResourceProbe | None = None,
) -> SoakReport:
    """Run ``body(iteration)`` until ``duration_s`` has passed, sampling every
    ``sample_every_s``; the baseline is taken before the first iteration."""
    probe = probe or ResourceProbe()
    baseline = probe.sample()
    samples = [baseline]
    iteration = 0
    next_sample = baseline.time + sample_every_s
    while time.monotonic() - baseline.time < duration_s:
        body(iteration)
        iteration += 1
        if time.monotonic() >= next_sample:
            samples.append(probe.sample())
            next_sample += sample_every_s
    final = probe.sample()
    samples.append(final)
    return SoakReport(
        iterations=iteration,
        growth_bytes_per_min=memory_growth_per_min(samples, warmup_s=warmup_s),
        leaks=tuple(leaks(baseline, final)),
        samples=tuple(samples),
    )
