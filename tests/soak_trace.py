"""Opt-in allocation tracing for soak runs: where does a process tree's memory grow?

Set ``DYNARL_SOAK_TRACE=DIR`` and a soak test that uses :func:`memory_trace` can trace
the Python allocations of its own process and of every process it starts afterwards (the
job's workers, through a ``sitecustomize`` put first on ``PYTHONPATH`` that handles
SIGUSR2). :meth:`MemoryTrace.take` acts here and signals the given children: the first
call starts ``tracemalloc`` (not at start-up: tracing torch's import would outlast the
workers' start timeout), every later one collects garbage and dumps a snapshot to
``DIR`` (what is left is live, not cycles awaiting the collector).
:meth:`MemoryTrace.report` compares each process's first and last snapshots by
traceback and lists the sites that grew at every snapshot, a leak's signature
(``DIR/report.txt``), and writes the RSS samples per process (``DIR/rss.json``).
With ``DYNARL_SOAK_TRACE_MODE=malloc`` each call dumps glibc's heap counters
(``mallinfo2``) instead, reported per process. Without the variable
:func:`memory_trace` returns None and nothing changes. A debugging aid, not a test: it
asserts nothing.
"""

from __future__ import annotations

import json
import os
import signal
import tracemalloc
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from soak_support import ResourceSample

FRAMES = 12
"""Frames kept per traced allocation."""

_SITE = """\
import ctypes, gc, json, os, signal, tracemalloc
_count = [0]
class _Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "{fields}".split()]
def _malloc():
    call = ctypes.CDLL(None).mallinfo2
    call.restype = _Info
    info = call()
    return {{n: getattr(info, n) for n in "{fields}".split()}}
def _trace(signum, frame):
    _count[0] += 1
    gc.collect()
    name = os.path.join({directory!r}, "%d-%03d" % (os.getpid(), _count[0]))
    if {mode!r} == "malloc":
        with open(name + ".malloc", "w") as out:
            json.dump(_malloc(), out)
    elif not tracemalloc.is_tracing():
        tracemalloc.start({frames})
    else:
        tracemalloc.take_snapshot().dump(name + ".snap")
signal.signal(signal.SIGUSR2, _trace)
"""
_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
"""glibc's ``struct mallinfo2``."""


def memory_trace() -> MemoryTrace | None:
    """A :class:`MemoryTrace` into ``$DYNARL_SOAK_TRACE``, or None when it is unset;
    ``DYNARL_SOAK_TRACE_MODE=malloc`` records glibc's heap counters instead of Python
    allocations (is native memory in use, or held free by the allocator?)."""
    directory = os.environ.get("DYNARL_SOAK_TRACE")
    mode = os.environ.get("DYNARL_SOAK_TRACE_MODE", "python")
    if mode not in ("python", "malloc"):
        raise ValueError(f"DYNARL_SOAK_TRACE_MODE must be python or malloc, got {mode!r}")
    return MemoryTrace(Path(directory), mode=mode) if directory else None


class MemoryTrace:
    """Traces this process and the children it starts from now on (see the module)."""

    def __init__(self, directory: Path, *, mode: str = "python") -> None:
        self.directory = directory.resolve()
        site = self.directory / "site"
        site.mkdir(parents=True, exist_ok=True)
        code = _SITE.format(frames=FRAMES, directory=str(self.directory), mode=mode, fields=_FIELDS)
        (site / "sitecustomize.py").write_text(code)
        paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
        self._here: dict[str, Any] = {}
        exec(compile(code.replace("signal.signal(", "_ = ("), "sitecustomize", "exec"), self._here)

    def take(self, children: Iterable[int]) -> None:
        """Python mode: start tracing (first call) or dump a snapshot; malloc mode: dump
        the heap counters — here and in every pid of ``children`` (they act between two
        bytecodes of their main thread: give them a moment)."""
        self._here["_trace"](signal.SIGUSR2, None)
        for pid in children:
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGUSR2)
                except ProcessLookupError:
                    continue

    def report(self, samples: Sequence[ResourceSample], *, top: int = 15) -> str:
        """Per process, its traced Python memory at each snapshot, the ``top`` allocation
        sites that grew most between its first and last snapshot, and the sites that grew
        at every snapshot (a leak's signature; its rate in KiB/min); also written with the
        RSS series under the trace directory."""
        rss = [{"time": s.time, "rss": {str(p): b for p, b in s.rss.items()}} for s in samples]
        (self.directory / "rss.json").write_text(json.dumps(rss))
        lines = self._malloc_report()
        by_pid: dict[str, list[Path]] = {}
        for path in sorted(self.directory.glob("*.snap")):
            by_pid.setdefault(path.name.split("-")[0], []).append(path)
        for pid, paths in sorted(by_pid.items()):
            if len(paths) >= 2:
                lines.extend(_python_report(pid, paths, top))
        text = "\n".join(lines)
        (self.directory / "report.txt").write_text(text)
        return text

    def _malloc_report(self) -> list[str]:
        """Per process, glibc's heap at each dump: in use (``uordblks`` + ``hblkhd``, mmapped
        chunks included) and held free in the arenas (``fordblks``), KiB."""
        by_pid: dict[str, list[dict[str, int]]] = {}
        for path in sorted(self.directory.glob("*.malloc")):
            by_pid.setdefault(path.name.split("-")[0], []).append(json.loads(path.read_text()))
        lines = []
        for pid, infos in sorted(by_pid.items()):
            used = [(i["uordblks"] + i["hblkhd"]) // 1024 for i in infos]
            free = [i["fordblks"] // 1024 for i in infos]
            lines.append(f"== pid {pid}: malloc in use {used} KiB, free in arenas {free} KiB")
        return lines


def _python_report(pid: str, paths: Sequence[Path], top: int) -> list[str]:
    """One process's part of :meth:`MemoryTrace.report` (snapshots in time order)."""
    snapshots = [tracemalloc.Snapshot.load(str(path)) for path in paths]
    sizes = [{s.traceback: s.size for s in snap.statistics("traceback")} for snap in snapshots]
    minutes = max((paths[-1].stat().st_mtime - paths[0].stat().st_mtime) / 60, 1e-9)
    totals = [sum(by_site.values()) // 1024 for by_site in sizes]
    lines = [f"== pid {pid}: traced Python memory at each snapshot {totals} KiB"]
    diff = snapshots[-1].compare_to(snapshots[0], "traceback")
    lines.append(f"-- grew most, first to last snapshot ({minutes:.1f} min):")
    for stat in diff[:top]:
        lines.append(
            f"{stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks "
            f"(now {stat.size / 1024:.0f} KiB)"
        )
        lines.extend(f"    {line}" for line in stat.traceback.format(limit=FRAMES))
    if len(snapshots) < 3:
        return lines
    series = {site: [by_site.get(site, 0) for by_site in sizes] for site in sizes[-1]}
    steady = [
        (site, sizes_) for site, sizes_ in series.items()
        if all(a < b for a, b in pairwise(sizes_))
    ]  # fmt: skip
    steady.sort(key=lambda item: item[1][0] - item[1][-1])
    lines.append(f"-- grew at every snapshot ({len(steady)} sites):")
    for site, sizes_ in steady[:top]:
        rate = (sizes_[-1] - sizes_[0]) / 1024 / minutes
        lines.append(f"{rate:+.1f} KiB/min (now {sizes_[-1] / 1024:.0f} KiB)")
        lines.extend(f"    {line}" for line in site.format(limit=FRAMES))
    return lines
