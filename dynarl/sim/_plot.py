"""Allocation-timeline plots: devices per component over time, one PNG per policy.

Drawn by :func:`dynarl.plots.allocation_timeline` (matplotlib, Agg backend, imported only
when a plot is drawn): a stacked step chart of the devices rollout, inference and the
trainer hold (and those in transit or free), with the iteration starts marked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from dynarl import plots
from dynarl.sim._results import Timeline

__all__ = ["plot_timeline", "plot_timelines"]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def plot_timeline(timeline: Timeline, path: str | Path, *, title: str = "") -> Path:
    """Draw one timeline to ``path`` (PNG); returns the path."""
    devices: dict[str, list[float]] = {
        name: [float(row[i]) for row in timeline.counts]
        for i, name in enumerate(timeline.components)
    }
    return plots.allocation_timeline(
        path,
        list(timeline.times),
        devices,
        marks=list(timeline.iteration_starts),
        end=timeline.end,
        title=title,
        ylabel="GPUs",
    )


def plot_timelines(
    timelines: Mapping[str, Timeline], directory: str | Path, *, prefix: str = ""
) -> list[Path]:
    """One PNG per policy in ``directory`` (``<prefix><policy>.png``); returns the paths."""
    directory = Path(directory)
    return [
        plot_timeline(tl, directory / f"{_safe(prefix + name)}.png", title=f"{prefix}{name}")
        for name, tl in timelines.items()
    ]
