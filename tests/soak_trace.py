"""Opt-in allocation tracing for soak runs: where does a process tree's memory grow?

Set ``DYNARL_SOAK_TRACE=DIR`` and a soak test that uses :func:`memory_trace` can trace
the Python allocations of its own process and of every process it starts afterwards (the
job's workers, through a ``sitecustomize`` put first on ``PYTHONPATH`` that handles
SIGUSR2). :meth:`MemoryTrace.take` acts here and signals the given children: the first
call starts ``tracemalloc`` (not at start-up: tracing torch's import would outlast the
workers' start timeout), every later one dumps a snapshot to ``DIR``.
:meth:`MemoryTrace.report` compares each process's first and last snapshots by
traceback (``DIR/report.txt``) and writes the RSS samples per process (``DIR/rss.json``).
Without the variable :func:`memory_trace` returns None and nothing changes. A debugging
aid, not a test: it asserts nothing.
"""

from __future__ import annotations

import json
import os
import signal
import tracemalloc
from collections.abc import Iterable, Sequence
from pathlib import Path

from soak_support import ResourceSample

FRAMES = 12
"""Frames kept per traced allocation."""

_SITE = """\
import os, signal, tracemalloc
_count = [0]
def _trace(signum, frame):
    if not tracemalloc.is_tracing():
        tracemalloc.start({frames})
        return
    _count[0] += 1
    name = "%d-%03d.snap" % (os.getpid(), _count[0])
    tracemalloc.take_snapshot().dump(os.path.join({directory!r}, name))
signal.signal(signal.SIGUSR2, _trace)
"""


def memory_trace() -> MemoryTrace | None:
    """A :class:`MemoryTrace` into ``$DYNARL_SOAK_TRACE``, or None when it is unset."""
    directory = os.environ.get("DYNARL_SOAK_TRACE")
    return MemoryTrace(Path(directory)) if directory else None


class MemoryTrace:
    """Traces this process and the children it starts from now on (see the module)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory.resolve()
        site = self.directory / "site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(
            _SITE.format(frames=FRAMES, directory=str(self.directory))
        )
        paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
        self._taken = 0

    def take(self, children: Iterable[int]) -> None:
        """Start tracing (first call) or dump a snapshot, here and in every pid of
        ``children`` (they act between two bytecodes of their main thread: give them a
        moment)."""
        if not tracemalloc.is_tracing():
            tracemalloc.start(FRAMES)
        else:
            self._taken += 1
            name = f"{os.getpid()}-{self._taken:03d}.snap"
            tracemalloc.take_snapshot().dump(str(self.directory / name))
        for pid in children:
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGUSR2)
                except ProcessLookupError:
                    continue

    def report(self, samples: Sequence[ResourceSample], *, top: int = 15) -> str:
        """Per process, the ``top`` allocation sites that grew most between its first and
        last snapshot; also written with the RSS series under the trace directory."""
        rss = [{"time": s.time, "rss": {str(p): b for p, b in s.rss.items()}} for s in samples]
        (self.directory / "rss.json").write_text(json.dumps(rss))
        by_pid: dict[str, list[Path]] = {}
        for path in sorted(self.directory.glob("*.snap")):
            by_pid.setdefault(path.name.split("-")[0], []).append(path)
        lines = []
        for pid, paths in sorted(by_pid.items()):
            if len(paths) < 2:
                continue
            first = tracemalloc.Snapshot.load(str(paths[0]))
            last = tracemalloc.Snapshot.load(str(paths[-1]))
            diff = last.compare_to(first, "traceback")
            total = sum(d.size_diff for d in diff)
            lines.append(f"== pid {pid}: traced Python memory {total / 1024:+.0f} KiB")
            for stat in diff[:top]:
                lines.append(
                    f"{stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks "
                    f"(now {stat.size / 1024:.0f} KiB)"
                )
                lines.extend(f"    {line}" for line in stat.traceback.format(limit=FRAMES))
        text = "\n".join(lines)
        (self.directory / "report.txt").write_text(text)
        return text
