"""Devices as CPU cores: which core each device's worker is pinned to, and how busy the
cores and processes are (read from ``/proc``).

With ``RuntimeConfig.pin_cores`` a CPU job treats each device as one core: the worker of
device ``d`` runs on the ``d``-th core this process may use (``sched_setaffinity``), and
every process it starts — an engine server and its engine core — inherits that core, with
the engine's OpenMP threads bound to it. :func:`pinned_cores` decides the mapping (pure);
:class:`CoreClock` measures each core's busy seconds between two readings of
``/proc/stat``; :func:`process_cpu_seconds` sums the CPU time of processes (a paused engine
should spend none).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["CoreClock", "CoreUsage", "pinned_cores", "process_cpu_seconds", "read_core_times"]

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


def process_cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) the live processes among ``pids`` have spent."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                stat = handle.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
        total += (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    return total


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
