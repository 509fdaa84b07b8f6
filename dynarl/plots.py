"""dynarl's drawing functions: PNG charts from plain numbers (matplotlib, Agg backend).

Every function takes sequences and mappings of floats — no dynarl type — and writes one
PNG, returning its path, so any layer can use them: ``dynarl events --plot`` (through
:func:`dynarl.sched._series.plot_ledger`), the simulator's timelines and the demo's curves.
This module imports nothing from dynarl (it sits below every layer) and imports
matplotlib only when a chart is drawn, selecting the Agg backend (no display needed).
matplotlib and rich come with the ``plots`` extra; :func:`plots_extra` turns a missing one
into an error that says so (``pip install 'dynarl[plots]'``).

- :func:`allocation_timeline`: devices per component over time, stacked steps;
- :func:`line_chart`: one line per named series (utilization per component, reward and
  loss curves), optionally stepped;
- :func:`predicted_vs_measured`: one panel per component, a prediction against what was
  measured (throughput over time);
- :func:`parity_chart`: predicted against realised values with the ``y = x`` line (one
  point per move);
- :func:`allocation_timelines`: one allocation timeline panel per run, on a shared time
  axis (the demo's dynarl-versus-static figure);
- :func:`line_panels`: one panel per quantity, one line per run in each (reward and loss
  per step of several runs);
- :func:`plots_extra`: the block around an import of matplotlib or rich (the demo's live
  view).

Components get stable colours by name (:data:`COLORS`, then a fixed cycle). Raises
ValueError when series lengths disagree.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "COLORS",
    "allocation_timeline",
    "allocation_timelines",
    "color_of",
    "line_chart",
    "line_panels",
    "parity_chart",
    "plots_extra",
    "predicted_vs_measured",
]

COLORS: Mapping[str, str] = {
    "rollout": "#4c72b0",
    "inference": "#55a868",
    "reward": "#8172b3",
    "tool": "#937860",
    "tools": "#937860",
    "trainer": "#dd8452",
    "transit": "#c44e52",
    "free": "#cccccc",
}
"""Colours of the usual component names (and of the ``transit`` and ``free`` bands)."""

_CYCLE = ("#64b5cd", "#da8bc3", "#8c8c8c", "#ccb974", "#4c9f70", "#b07aa1")


def color_of(name: str) -> str:
    """The colour of series ``name``: its entry in :data:`COLORS`, else a stable pick."""
    return COLORS.get(name) or _CYCLE[zlib.crc32(name.encode()) % len(_CYCLE)]


@contextmanager
def plots_extra(purpose: str) -> Iterator[None]:
    """The block imports a package of the ``plots`` extra (matplotlib, rich).

    Raises ModuleNotFoundError (chained to the original, same ``name``) saying that
    ``purpose`` needs the missing package and how to install the extra.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        package = exc.name.partition(".")[0] if exc.name else "matplotlib or rich"
        raise ModuleNotFoundError(
            f"{purpose} needs {package} (the 'plots' extra): pip install 'dynarl[plots]'",
            name=exc.name,
        ) from exc


@contextmanager
def _figure(
    path: str | Path, *, rows: int = 1, size: tuple[float, float] = (9.0, 3.6)
) -> Iterator[tuple[Any, Any]]:
    with plots_extra("drawing charts"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(size[0], size[1] * rows), dpi=110, squeeze=False)
    try:
        yield fig, [row[0] for row in axes]
        fig.tight_layout()
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target)
    finally:
        plt.close(fig)


def _check(name: str, xs: Sequence[float], ys: Sequence[float]) -> None:
    if len(xs) != len(ys):
        raise ValueError(f"series {name!r} has {len(xs)} x values but {len(ys)} y values")


def allocation_timeline(
    path: str | Path,
    times: Sequence[float],
    devices: Mapping[str, Sequence[float]],
    *,
    marks: Sequence[float] = (),
    end: float | None = None,
    title: str = "",
    ylabel: str = "devices",
) -> Path:
    """Stacked steps of ``devices[name][i]`` from ``times[i]`` on, the last one until
    ``end`` (when the run ended; without it, or when it is not after the last time, the
    last step is extended a little so it shows); dotted vertical lines at ``marks``
    (iteration starts).
    """
    for name, counts in devices.items():
        _check(name, times, counts)
    with _figure(path) as (_, (ax,)):
        if times:
            last = times[-1] + max(1.0, 0.02 * (times[-1] - times[0]))
            xs = [*times, end if end is not None and end > times[-1] else last]
            names = list(devices)
            ax.stackplot(
                xs,
                *[[*devices[n], devices[n][-1]] for n in names],
                labels=names,
                colors=[color_of(n) for n in names],
                step="post",
            )
            ax.set_xlim(xs[0], xs[-1])
            ax.legend(loc="upper right", fontsize="small", ncol=max(1, len(names)))
        for mark in marks:
            ax.axvline(mark, color="black", linewidth=0.6, linestyle=":")
        ax.set_xlabel("time (s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    return Path(path)


def line_chart(
    path: str | Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str = "time (s)",
    ylabel: str = "",
    title: str = "",
    marks: Sequence[float] = (),
    step: bool = False,
    ylim: tuple[float, float] | None = None,
) -> Path:
    """One line per ``series[name] = (xs, ys)``; ``step`` draws post-steps (gauges)."""
    with _figure(path) as (_, (ax,)):
        for name, (xs, ys) in series.items():
            _check(name, xs, ys)
            if step:
                ax.step(xs, ys, where="post", label=name, color=color_of(name))
            else:
                ax.plot(
                    xs, ys, label=name, color=color_of(name), marker="." if len(xs) < 40 else ""
                )
        for mark in marks:
            ax.axvline(mark, color="black", linewidth=0.6, linestyle=":")
        if ylim is not None:
            ax.set_ylim(*ylim)
        if series:
            ax.legend(loc="best", fontsize="small")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    return Path(path)


def predicted_vs_measured(
    path: str | Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float]]],
    *,
    ylabel: str = "items/s",
    title: str = "",
    marks: Sequence[float] = (),
) -> Path:
    """One panel per ``series[name] = (times, predicted, measured)``: the prediction
    dashed, the measurement solid."""
    rows = max(1, len(series))
    with _figure(path, rows=rows, size=(9.0, 2.6)) as (fig, axes):
        for ax, (name, (times, predicted, measured)) in zip(axes, series.items(), strict=False):
            _check(f"{name} predicted", times, predicted)
            _check(f"{name} measured", times, measured)
            color = color_of(name)
            ax.step(times, measured, where="post", color=color, label=f"{name} measured")
            ax.step(times, predicted, where="post", color=color, linestyle="--", label="predicted")
            for mark in marks:
                ax.axvline(mark, color="black", linewidth=0.6, linestyle=":")
            ax.set_ylabel(ylabel)
            ax.legend(loc="upper right", fontsize="small")
        axes[-1].set_xlabel("time (s)")
        fig.suptitle(title)
    return Path(path)


def parity_chart(
    path: str | Path,
    predicted: Sequence[float],
    realised: Sequence[float],
    *,
    labels: Sequence[str] = (),
    unit: str = "s",
    title: str = "",
) -> Path:
    """A point per pair (``predicted[i]``, ``realised[i]``), labelled, with ``y = x``."""
    _check("parity", predicted, realised)
    with _figure(path, size=(5.0, 4.6)) as (_, (ax,)):
        ax.scatter(predicted, realised, color=color_of("trainer"), zorder=3)
        for x, y, label in zip(predicted, realised, labels, strict=False):
            ax.annotate(
                label, (x, y), fontsize="x-small", xytext=(3, 3), textcoords="offset points"
            )
        values = [*predicted, *realised]
        low, high = (min(values), max(values)) if values else (0.0, 1.0)
        pad = 0.05 * (high - low or 1.0)
        ax.plot([low - pad, high + pad], [low - pad, high + pad], color="black", linewidth=0.6)
        ax.set_xlabel(f"predicted ({unit})")
        ax.set_ylabel(f"realised ({unit})")
        ax.set_title(title)
    return Path(path)


def allocation_timelines(
    path: str | Path,
    runs: Mapping[str, tuple[Sequence[float], Mapping[str, Sequence[float]], Sequence[float]]],
    *,
    title: str = "",
    ylabel: str = "devices",
) -> Path:
    """One panel per ``runs[label] = (times, devices per component, marks)`` (stacked steps
    as in :func:`allocation_timeline`), every panel on the same time axis; each run's
    area ends (a little after) its own last time, so a shorter run looks shorter."""
    rows = max(1, len(runs))
    end = max((ts[-1] for ts, _, _ in runs.values() if ts), default=1.0)
    with _figure(path, rows=rows, size=(9.0, 2.4)) as (fig, axes):
        for ax, (label, (times, devices, marks)) in zip(axes, runs.items(), strict=False):
            for name, counts in devices.items():
                _check(f"{label}/{name}", times, counts)
            if times:
                xs = [*times, times[-1] + 0.02 * max(end, 1.0)]
                names = list(devices)
                ax.stackplot(
                    xs,
                    *[[*devices[n], devices[n][-1]] for n in names],
                    labels=names,
                    colors=[color_of(n) for n in names],
                    step="post",
                )
                ax.set_xlim(0.0, end + 0.02 * max(end, 1.0))
                ax.legend(loc="upper right", fontsize="small", ncol=max(1, len(names)))
            for mark in marks:
                ax.axvline(mark, color="black", linewidth=0.6, linestyle=":")
            ax.set_ylabel(ylabel)
            ax.set_title(label, fontsize="medium")
        axes[-1].set_xlabel("time (s)")
        fig.suptitle(title)
    return Path(path)


def line_panels(
    path: str | Path,
    panels: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
    *,
    xlabel: str = "step",
    title: str = "",
) -> Path:
    """One panel per ``panels[quantity]``, one line per ``panels[quantity][run] = (xs,
    ys)``; the panel's y label is the quantity."""
    rows = max(1, len(panels))
    with _figure(path, rows=rows, size=(9.0, 2.6)) as (fig, axes):
        for ax, (quantity, series) in zip(axes, panels.items(), strict=False):
            for index, (name, (xs, ys)) in enumerate(series.items()):
                _check(f"{quantity}/{name}", xs, ys)
                ax.plot(
                    xs,
                    ys,
                    label=name,
                    color=color_of(name),
                    marker="ox^sv"[index % 5],
                    linestyle="-" if index == 0 else "--",
                    alpha=0.9,
                )
            ax.set_ylabel(quantity)
            if series:
                ax.legend(loc="best", fontsize="small")
        axes[-1].set_xlabel(xlabel)
        fig.suptitle(title)
    return Path(path)
