"""Allocation-timeline plots: devices per component over time, one PNG per policy.

matplotlib with the Agg backend (no display needed), imported only when a plot is drawn.
Each figure is a stacked step chart of the devices rollout, inference and the trainer hold
(and those in transit or free), with the iteration starts marked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from dynarl.sim.report import Timeline

__all__ = ["plot_timeline", "plot_timelines"]

_COLORS = {
    "rollout": "#4c72b0",
    "inference": "#55a868",
    "trainer": "#dd8452",
    "transit": "#c44e52",
    "free": "#cccccc",
}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def plot_timeline(timeline: Timeline, path: str | Path, *, title: str = "") -> Path:
    """Draw one timeline to ``path`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    if timeline.times:
        times = list(timeline.times)
        end = times[-1] + max(1.0, 0.02 * (times[-1] - times[0]))
        times.append(end)
        columns = list(zip(*timeline.counts, strict=True))
        series = [[*col, col[-1]] for col in columns]
        ax.stackplot(
            times,
            *series,
            labels=list(timeline.components),
            colors=[_COLORS.get(c, "#999999") for c in timeline.components],
            step="post",
        )
        for start in timeline.iteration_starts:
            ax.axvline(start, color="black", linewidth=0.6, linestyle=":")
        ax.set_xlim(times[0], end)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GPUs")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize="small", ncol=5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_timelines(
    timelines: Mapping[str, Timeline], directory: str | Path, *, prefix: str = ""
) -> list[Path]:
    """One PNG per policy in ``directory`` (``<prefix><policy>.png``); returns the paths."""
    directory = Path(directory)
    return [
        plot_timeline(tl, directory / f"{_safe(prefix + name)}.png", title=f"{prefix}{name}")
        for name, tl in timelines.items()
    ]
