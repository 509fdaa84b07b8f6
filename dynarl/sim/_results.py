"""What a simulation run yields: the allocation timeline, per-iteration figures, the table.

:class:`GpuAccounts` and :func:`summarise` turn a run's GPU-seconds and iterations into
its figures.

:class:`Timeline` is the step function of devices per component (what the plots draw
and what the timeline validation reads). :class:`RunResult` holds one policy's figures
over the measured iterations; :func:`format_table` and :func:`results_json` render a
comparison with speedups over every baseline present, :func:`format_sweep` the runs of a
sweep in one table. Pure data and formatting.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dynarl.errors import DynarlError
from dynarl.sim._workload_file import Workload

__all__ = [
    "BASELINES",
    "GpuAccounts",
    "IterationStats",
    "RunResult",
    "Timeline",
    "format_sweep",
    "format_table",
    "results_json",
    "speedups",
    "summarise",
]

BASELINES = ("static-sequential", "static-split", "rlinf-rule", "verl-hybrid")
"""Policies the others are compared against, when present."""


@dataclass(slots=True)
class Timeline:
    """Devices per component over time; ``transit`` holds devices between two owners."""

    components: tuple[str, ...]
    """Component names (plus ``free`` and ``transit``), in drawing order."""
    times: list[float] = field(default_factory=list)
    """Times of changes, ascending."""
    counts: list[tuple[int, ...]] = field(default_factory=list)
    """Devices per component from each time on."""
    iteration_starts: list[float] = field(default_factory=list)
    """When each iteration began."""
    num_warmup_iterations: int = 0
    """How many of the first iterations are warm-up, left out of the figures."""
    end: float | None = None
    """When the run ended (the last counts hold until then); None while it runs."""

    def record(self, time: float, counts: Mapping[str, int]) -> None:
        """Note the counts in force from ``time`` (merged with a change at the same time)."""
        row = tuple(int(counts.get(name, 0)) for name in self.components)
        if self.times and self.times[-1] == time:
            self.counts[-1] = row
        elif not self.counts or self.counts[-1] != row:
            self.times.append(time)
            self.counts.append(row)

    def count_at(self, component: str, time: float) -> int:
        """Devices ``component`` holds at ``time`` (0 before the first record)."""
        i = bisect.bisect_right(self.times, time) - 1
        return 0 if i < 0 else self.counts[i][self.components.index(component)]

    def first_reach(self, component: str, num: int, start: float, end: float) -> float | None:
        """First time in [start, end) ``component`` holds at least ``num`` devices."""
        column = self.components.index(component)
        if self.count_at(component, start) >= num:
            return start
        i = bisect.bisect_right(self.times, start)
        while i < len(self.times) and self.times[i] < end:
            if self.counts[i][column] >= num:
                return self.times[i]
            i += 1
        return None

    def ramp_time(self, component: str, num: int, start: float, end: float) -> float | None:
        """First time in [start, end) ``component`` holds ``num`` devices again after its low.

        The low is the first time it holds the fewest devices in the window (at an
        iteration start the trainer still holds what it grew to in the last one).
        """
        column = self.components.index(component)
        i = bisect.bisect_right(self.times, start)
        points = [(start, self.count_at(component, start))]
        while i < len(self.times) and self.times[i] < end:
            points.append((self.times[i], self.counts[i][column]))
            i += 1
        low = min(count for _, count in points)
        after = next(k for k, (_, count) in enumerate(points) if count == low)
        return next((t for t, count in points[after:] if count >= num), None)

    def peak(self, component: str, start: float, end: float) -> int:
        """Most devices ``component`` holds in [start, end)."""
        column = self.components.index(component)
        best = self.count_at(component, start)
        i = bisect.bisect_right(self.times, start)
        while i < len(self.times) and self.times[i] < end:
            best = max(best, self.counts[i][column])
            i += 1
        return best


@dataclass(frozen=True, kw_only=True, slots=True)
class IterationStats:
    """One iteration (sync: a training step; async: a weight-sync cycle)."""

    index: int
    start: float
    end: float
    samples: int
    tokens: int

    @property
    def seconds(self) -> float:
        """Its wall time."""
        return self.end - self.start


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """One policy on one workload, over the measured (post-warm-up) iterations."""

    policy: str
    workload: str
    unit: str
    """``tokens/s`` (math) or ``episodes/s`` (agentic)."""
    throughput: float
    iteration_s: float
    moves: float
    """Reallocations executed per iteration."""
    migration_share: float
    """Share of GPU-seconds spent in migrations and stage switches."""
    idle_share: float
    """Share of GPU-seconds with nothing to run (free devices included)."""
    reprefill_share: float
    """Share of prefilled tokens that were computed before (lost cache, moved requests)."""
    iterations: tuple[IterationStats, ...]
    timeline: Timeline
    num_decisions: int = 0
    """Scheduler decision rounds (dynarl only)."""
    extra: Mapping[str, float] = field(default_factory=dict)
    """Policy-specific figures."""

    def record(self) -> dict[str, object]:
        """The JSON record of this run."""
        return {
            "policy": self.policy,
            "throughput": self.throughput,
            "unit": self.unit,
            "iteration_s": self.iteration_s,
            "moves": self.moves,
            "idle_share": self.idle_share,
            "migration_share": self.migration_share,
            "reprefill_share": self.reprefill_share,
        }


@dataclass(slots=True)
class GpuAccounts:
    """GPU-seconds per iteration: busy, idle (free devices included), migrating."""

    per_iteration: dict[int, list[float]] = field(default_factory=dict)

    def add(self, iteration: int, busy: float, idle: float, migrating: float) -> None:
        """Add one interval's GPU-seconds to ``iteration``."""
        row = self.per_iteration.setdefault(iteration, [0.0, 0.0, 0.0])
        row[0] += busy
        row[1] += idle
        row[2] += migrating


def summarise(
    *,
    policy: str,
    workload: Workload,
    iterations: Sequence[IterationStats],
    accounts: GpuAccounts,
    moves_per_iteration: Mapping[int, int],
    prefill: tuple[int, int],
    timeline: Timeline,
) -> RunResult:
    """A run's figures over its measured (post-warm-up) iterations.

    Raises DynarlError when no measured iteration finished.
    """
    measured = [it for it in iterations if it.index >= workload.num_warmup_iterations]
    if not measured:
        raise DynarlError("no measured iteration finished")
    span = measured[-1].end - measured[0].start
    if workload.kind == "math":
        amount, unit = float(sum(it.tokens for it in measured)), "tokens/s"
    else:
        amount, unit = float(sum(it.samples for it in measured)), "episodes/s"
    rows = [accounts.per_iteration.get(it.index, [0.0] * 3) for it in measured]
    busy, idle, mig = (sum(r[i] for r in rows) for i in range(3))
    total = busy + idle + mig
    moves = sum(moves_per_iteration.get(it.index, 0) for it in measured)
    return RunResult(
        policy=policy,
        workload=workload.name,
        unit=unit,
        throughput=amount / span if span > 0 else math.inf,
        iteration_s=sum(it.seconds for it in measured) / len(measured),
        moves=moves / len(measured),
        migration_share=mig / total if total else 0.0,
        idle_share=idle / total if total else 0.0,
        reprefill_share=prefill[1] / prefill[0] if prefill[0] else 0.0,
        iterations=tuple(iterations),
        timeline=timeline,
    )


def speedups(results: Sequence[RunResult]) -> dict[str, dict[str, float]]:
    """Throughput of each policy over each baseline present: ``{policy: {baseline: x}}``."""
    by_name = {r.policy: r for r in results}
    out: dict[str, dict[str, float]] = {}
    for r in results:
        out[r.policy] = {
            b: (r.throughput / by_name[b].throughput if by_name[b].throughput > 0 else math.inf)
            for b in BASELINES
            if b in by_name and b != r.policy
        }
    return out


def _figures_head(unit: str, bases: Sequence[str]) -> list[str]:
    head = [f"throughput ({unit})", "iter s", "moves/it", "migr %", "idle %"]
    return head + [f"vs {b}" for b in bases]


def _figures(r: RunResult, ups: Mapping[str, float], bases: Sequence[str]) -> list[str]:
    """``r``'s cells under :func:`_figures_head`; ``ups``: its speedups."""
    row = [
        f"{r.throughput:,.1f}" if r.throughput >= 100 else f"{r.throughput:.3f}",
        f"{r.iteration_s:.1f}",
        f"{r.moves:.1f}",
        f"{100 * r.migration_share:.1f}",
        f"{100 * r.idle_share:.1f}",
    ]
    return row + [f"{ups[b]:.2f}x" if b in ups else "-" for b in bases]


def _layout(head: list[str], rows: list[list[str]], *, left: int, title: str) -> str:
    """Fixed-width columns, the first ``left`` of them left-aligned, numbers right."""
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines = [title] if title else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        cells = [
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def _bases(results: Sequence[RunResult]) -> list[str]:
    return [b for b in BASELINES if any(r.policy == b for r in results)]


def format_table(results: Sequence[RunResult], title: str = "") -> str:
    """A fixed-width table of the runs, speedups over each baseline present."""
    bases = _bases(results)
    ups = speedups(results)
    unit = results[0].unit if results else ""
    rows = [[r.policy, *_figures(r, ups[r.policy], bases)] for r in results]
    return _layout(["policy", *_figures_head(unit, bases)], rows, left=1, title=title)


def format_sweep(
    key: str, points: Sequence[tuple[object, Sequence[RunResult]]], title: str = ""
) -> str:
    """One fixed-width table of a sweep: a row per ``points[i] = (value, results)`` (a row
    per value and policy when several ran), the figures of :func:`format_table`, each
    speedup over the baseline run with the same value; then the value and policy of the
    highest throughput."""
    every = [r for _, results in points for r in results]
    bases = _bases(every)
    several = len({r.policy for r in every}) > 1
    rows = []
    for value, results in points:
        ups = speedups(results)
        for r in results:
            named = [str(value), r.policy] if several else [str(value)]
            rows.append([*named, *_figures(r, ups[r.policy], bases)])
    head = [key, "policy"] if several else [key]
    unit = every[0].unit if every else ""
    table = _layout([*head, *_figures_head(unit, bases)], rows, left=len(head), title=title)
    if len(points) < 2:
        return table
    value, best = max(
        ((v, r) for v, results in points for r in results), key=lambda pair: pair[1].throughput
    )
    return f"{table}\nhighest throughput: {key}={value} ({best.policy})"


def results_json(
    results: Sequence[RunResult], *, workload: str, extra: Mapping[str, object] | None = None
) -> str:
    """One JSON document: a record per policy and the speedups."""
    doc: dict[str, object] = {
        "workload": workload,
        "unit": results[0].unit if results else "",
        "policies": [r.record() for r in results],
        "speedups": speedups(results),
    }
    if extra:
        doc.update(extra)
    return json.dumps(doc, indent=2, sort_keys=False)
