"""Charts of simulation runs: allocation timelines per policy, and a sweep's figures.

Drawn by :mod:`dynarl.plots` (matplotlib, Agg backend, imported only when a chart is
drawn). A timeline is a stacked step chart of the devices rollout, inference and the
trainer hold (and those in transit or free), with the iteration starts marked and named
and the warm-up shaded; the policies of one comparison share one time axis, in their own
charts and side by side in one more. A sweep's chart draws iteration time, throughput
and the speedup over a baseline against the swept value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from dynarl import plots
from dynarl.sim._results import BASELINES, RunResult, Timeline, speedups

__all__ = ["plot_sweep", "plot_timeline", "plot_timelines"]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def _allocation(timeline: Timeline) -> plots.Allocation:
    """What :mod:`dynarl.plots` draws of ``timeline``."""
    starts = list(timeline.iteration_starts)
    warmup = None
    num_warmup = timeline.num_warmup_iterations
    if num_warmup > 0 and starts:
        last = timeline.end if timeline.end is not None else timeline.times[-1]
        warmup = (starts[0], starts[num_warmup] if len(starts) > num_warmup else last)
    return plots.Allocation(
        times=list(timeline.times),
        devices={
            name: [float(row[i]) for row in timeline.counts]
            for i, name in enumerate(timeline.components)
        },
        end=timeline.end,
        marks=starts,
        mark_names=[f"iteration {i}" for i in range(len(starts))],
        warmup=warmup,
    )


def plot_timeline(
    timeline: Timeline,
    path: str | Path,
    *,
    title: str = "",
    xlim: tuple[float, float] | None = None,
) -> Path:
    """Draw one timeline to ``path`` (PNG), its time axis spanning ``xlim`` (else the
    run); returns the path."""
    run = _allocation(timeline)
    return plots.allocation_timeline(
        path,
        run.times,
        run.devices,
        marks=run.marks,
        mark_names=run.mark_names,
        warmup=run.warmup,
        end=run.end,
        xlim=xlim,
        title=title,
        ylabel="GPUs",
    )


def plot_timelines(
    timelines: Mapping[str, Timeline], directory: str | Path, *, prefix: str = ""
) -> list[Path]:
    """One PNG per policy in ``directory`` (``<prefix><policy>.png``), all on the same
    time axis, and with two policies or more one PNG of them all side by side
    (``<prefix>policies.png``, last); returns the paths."""
    directory = Path(directory)
    ends = [tl.end if tl.end is not None else tl.times[-1] for tl in timelines.values() if tl.times]
    xlim = (0.0, max(ends, default=1.0))
    paths = [
        plot_timeline(
            tl, directory / f"{_safe(prefix + name)}.png", title=f"{prefix}{name}", xlim=xlim
        )
        for name, tl in timelines.items()
    ]
    if len(timelines) > 1:
        paths.append(
            plots.allocation_timelines(
                directory / f"{_safe(prefix + 'policies')}.png",
                {name: _allocation(tl) for name, tl in timelines.items()},
                title=f"{prefix.rstrip('-')}: GPUs per component, every policy on one time axis",
                ylabel="GPUs",
            )
        )
    return paths


def plot_sweep(
    key: str,
    points: Sequence[tuple[object, Sequence[RunResult]]],
    directory: str | Path,
    *,
    prefix: str = "",
    title: str = "",
) -> Path:
    """Draw a sweep to ``<directory>/<prefix>sweep-<key>.png``: per ``points[i] = (value,
    results)``, each policy's iteration time, throughput and, when a baseline ran at every
    value, its speedup over the first such baseline (``BASELINES`` order), against
    ``key``; returns the path."""
    policies = list(dict.fromkeys(r.policy for _, results in points for r in results))
    unit = next((r.unit for _, results in points for r in results), "")
    by_value = [{r.policy: r for r in results} for _, results in points]

    def figure(read: str) -> dict[str, list[float]]:
        return {
            p: [float(getattr(runs[p], read)) if p in runs else math.nan for runs in by_value]
            for p in policies
        }

    panels: dict[str, Mapping[str, Sequence[float]]] = {
        "iteration time (s)": figure("iteration_s"),
        f"throughput ({unit})": figure("throughput"),
    }
    levels = {}
    base = next((b for b in BASELINES if all(b in runs for runs in by_value)), None)
    if base is not None:
        ups = [speedups(results) for _, results in points]
        ratio = f"speedup over {base} (x)"
        panels[ratio] = {
            p: [u.get(p, {}).get(base, math.nan) for u in ups] for p in policies if p != base
        }
        levels[ratio] = 1.0
    values = [
        v if isinstance(v, int | float) and not isinstance(v, bool) else str(v) for v, _ in points
    ]
    path = Path(directory) / f"{_safe(f'{prefix}sweep-{key}')}.png"
    return plots.sweep_chart(path, values, panels, xlabel=key, levels=levels, title=title)
