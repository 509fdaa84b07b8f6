"""Devices as CPU cores: which core each device's worker is pinned to, and how busy the
cores and processes are (read from ``/proc``).

With ``RuntimeConfig.pin_cores`` a CPU job treats each device as one core: the worker of
device ``d`` runs on the ``d``-th core this process may use (``sched_setaffinity``), and
every process it starts — an engine server and its engine core — inherits that core, with
the engine's OpenMP threads bound to it. :func:`pinned_cores` decides the mapping (pure);
:class:`CoreClock` measures each core's busy seconds between two readings of
``/proc/stat``; :func:`process_cpu_seconds` sums the CPU time of processes (a paused engine
should spend none); :class:`LoadMeter` tells how much CPU *other* processes took while
this one and everything it started ran (a comparison of wall times made under foreign
load says less than it seems).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "FOREIGN_LOAD_LIMIT",
    "CoreClock",
    "CoreUsage",
    "ForeignLoad",
    "LoadMeter",
    "pinned_cores",
    "process_cpu_seconds",
    "read_core_times",
    "tree_cpu_seconds",
]

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""``/proc/stat`` cpu columns counted as busy: user, nice, system, irq, softirq, steal (not
idle, iowait, or guest, which user already includes)."""


def pinned_cores(
    num_devices: int, available: Iterable[int], *, setting: str = "RuntimeConfig.pin_cores"
) -> dict[int, int]:
    """Device → core: device ``d`` on the ``d``-th of the ``available`` cores (sorted).

    Raises ValueError, naming ``setting``, when there are more devices than cores: a device
    is one core.
    """
    cores = sorted(set(available))
    if num_devices > len(cores):
        whose = "the job has" if setting.startswith("RuntimeConfig") else "this node has"
        raise ValueError(
            f"{setting}: {whose} {num_devices} devices but this process may run on "
            f"{len(cores)} cores ({_ranges(cores)}); with pinning each device is one core"
        )
    return {device: cores[device] for device in range(num_devices)}


def read_core_times(stat: str | None = None) -> dict[int, float]:
    """Busy seconds of every core since boot, from ``/proc/stat`` (or its text ``stat``)."""
    if stat is None:
        with open("/proc/stat") as handle:
            stat = handle.read()
    times: dict[int, float] = {}
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        columns = rest.split()
        times[int(name[3:])] = sum(int(columns[i]) for i in _BUSY_FIELDS) / _TICKS_PER_S
    return times


def process_cpu_seconds(pids: Iterable[int], *, reaped: bool = False) -> float:
    """CPU seconds (user + system) the live processes among ``pids`` have spent; with
    ``reaped``, also what the children they have waited for spent (their ``cutime`` and
    ``cstime``, which carry a reaped child's own reaped children in turn)."""
    columns = (11, 12, 13, 14) if reaped else (11, 12)
    total = 0.0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            total += sum(int(fields[i]) for i in columns) / _TICKS_PER_S
    return total


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds spent so far by process ``root`` (default: this one) and every process
    below it, the reaped ones included: what :class:`LoadMeter` counts as its own."""
    root = os.getpid() if root is None else root
    pids, frontier = [root], [root]
    while frontier:
        children = [child for pid in frontier for child in _children(pid)]
        pids += children
        frontier = children
    return process_cpu_seconds(pids, reaped=True)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces);
    None for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rpartition(")")[2].split()


def _children(pid: int) -> list[int]:
    """The live children of ``pid`` (every thread's), from ``/proc``."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found += [int(child) for child in handle.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


FOREIGN_LOAD_LIMIT = 0.2
"""Cores of foreign load, on average over a run, from which a comparison of wall times is
flagged as made under foreign load."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ForeignLoad:
    """What the machine's cores did over a span, split into this process tree's share and
    everybody else's."""

    wall_s: float
    """The span, seconds."""
    busy_s: float
    """Busy seconds of every core of the machine together."""
    own_s: float
    """CPU seconds of this process and everything below it."""

    @property
    def foreign_s(self) -> float:
        """CPU seconds other processes took (never below 0: the two clocks tick apart)."""
        return max(0.0, self.busy_s - self.own_s)

    @property
    def foreign_cores(self) -> float:
        """Other processes' load, in cores on average over the span."""
        return self.foreign_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def loaded(self) -> bool:
        """Whether the span ran under foreign load (:data:`FOREIGN_LOAD_LIMIT` or more)."""
        return self.foreign_cores >= FOREIGN_LOAD_LIMIT

    def to_json(self) -> dict[str, float]:
        """Seconds and cores, rounded."""
        return {
            "wall_s": round(self.wall_s, 3),
            "busy_s": round(self.busy_s, 3),
            "own_s": round(self.own_s, 3),
            "foreign_s": round(self.foreign_s, 3),
            "foreign_cores": round(self.foreign_cores, 3),
        }


class LoadMeter:
    """Measures a span (from construction to :meth:`read`): the machine's busy core
    seconds (``/proc/stat``) against this process tree's CPU seconds."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._busy = sum(read_core_times().values())
        self._own = tree_cpu_seconds()

    def read(self) -> ForeignLoad:
        """The span so far."""
        return ForeignLoad(
            wall_s=time.monotonic() - self._start,
            busy_s=max(0.0, sum(read_core_times().values()) - self._busy),
            own_s=max(0.0, tree_cpu_seconds() - self._own),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class CoreUsage:
    """How busy each core was over a span of wall time."""

    wall_s: float
    """The span, seconds."""
    busy_s: Mapping[int, float]
    """Core → busy seconds in the span."""
    devices: Mapping[int, int]
    """Device → the core it was pinned to (empty: not pinned)."""

    def fraction(self, core: int) -> float:
        """``core``'s busy share of the span (0 to 1)."""
        return self.busy_s[core] / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        """For ``cores.json``: the span, each core's busy seconds and share, the pinning."""
        return {
            "wall_s": round(self.wall_s, 3),
            "cores": {
                str(core): {
                    "busy_s": round(busy, 3),
                    "busy_fraction": round(self.fraction(core), 4),
                }
                for core, busy in sorted(self.busy_s.items())
            },
            "pinned": {str(device): core for device, core in sorted(self.devices.items())},
        }


class CoreClock:
    """Busy seconds of every core since it was made (:meth:`usage`)."""

    def __init__(self, devices: Mapping[int, int] | None = None) -> None:
        self.devices = dict(devices or {})
        self._start = time.monotonic()
        self._times = read_core_times()

    def usage(self) -> CoreUsage:
        """Each core's busy seconds since this clock was made."""
        now = read_core_times()
        busy = {core: max(0.0, now[core] - self._times.get(core, 0.0)) for core in now}
        return CoreUsage(wall_s=time.monotonic() - self._start, busy_s=busy, devices=self.devices)


def _ranges(cores: Sequence[int]) -> str:
    """``0-3,6`` for cores 0, 1, 2, 3, 6 (sorted, distinct)."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and runs[-1][-1] == core - 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
