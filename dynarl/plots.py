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
- :func:`allocation_timelines`: one allocation timeline panel per run (an
  :class:`Allocation`), on a shared time axis (the demo's dynarl-versus-static figure, the
  simulator's policies side by side);
- :func:`line_panels`: one panel per quantity, one line per run in each (reward and loss
  per step of several runs);
- :func:`sweep_chart`: one panel per figure, one line per run, against a swept setting;
- :func:`plots_extra`: the block around an import of matplotlib or rich (the demo's live
  view).

Components get stable colours by name (:data:`COLORS`, then a fixed cycle). Legends sit
right of the plotting area, never over it; dotted lines (iteration starts, moves) have a
legend entry and, where named, their names above the plot; device counts and steps get
integer ticks. Raises ValueError when series lengths disagree.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COLORS",
    "Allocation",
    "allocation_timeline",
    "allocation_timelines",
    "color_of",
    "line_chart",
    "line_panels",
    "parity_chart",
    "plots_extra",
    "predicted_vs_measured",
    "sweep_chart",
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

_RUN_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
"""Colours of the runs of a sweep chart, in order (policies, not components)."""


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


@dataclass(frozen=True, kw_only=True, slots=True)
class Allocation:
    """One run's devices per component over time, as :func:`allocation_timelines` draws it.

    Raises ValueError when a component's counts, or the mark names, do not match in length.
    """

    times: Sequence[float]
    """When the counts change, ascending."""
    devices: Mapping[str, Sequence[float]]
    """Devices per component from each time on, stacked in this order."""
    end: float | None = None
    """When the run ended (the last counts hold until then); None: just after the last time."""
    marks: Sequence[float] = ()
    """Iteration (or step) starts, drawn as dotted lines."""
    mark_names: Sequence[str] = ()
    """A name per mark (``iteration 2``), written above the plot; empty: none."""
    warmup: tuple[float, float] | None = None
    """The warm-up span, shaded as not measured; None: no warm-up."""

    def __post_init__(self) -> None:
        for name, counts in self.devices.items():
            _check(name, self.times, counts)
        if self.mark_names and len(self.mark_names) != len(self.marks):
            raise ValueError(f"{len(self.mark_names)} mark names for {len(self.marks)} marks")

    def stop(self, pad: float) -> float:
        """Where the last step ends: ``end``, else ``pad`` after the last time."""
        last = self.times[-1] if self.times else 0.0
        return self.end if self.end is not None and self.end >= last else last + pad


_MAX_NAMES = 8
"""Mark names written above a plot at most (evenly picked), so they do not collide."""


@contextmanager
def _figure(
    path: str | Path,
    *,
    rows: int = 1,
    size: tuple[float, float] = (9.0, 3.6),
    sharex: bool = False,
) -> Iterator[tuple[Any, Any]]:
    with plots_extra("drawing charts"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        rows, 1, figsize=(size[0], size[1] * rows), dpi=110, squeeze=False, sharex=sharex
    )
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


def _legend_outside(ax: Any, entries: Mapping[str, Any] | None = None) -> None:
    """The legend of ``ax`` (or of ``entries``, label to handle) right of its plotting area,
    where it hides nothing; nothing when there is nothing to list."""
    if entries is None:
        handles, labels = ax.get_legend_handles_labels()
        entries = dict(zip(labels, handles, strict=True))
    if entries:
        ax.legend(
            list(entries.values()),
            list(entries),
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            borderaxespad=0.0,
            fontsize="small",
            frameon=False,
        )


def _marks(ax: Any, marks: Sequence[float], *, label: str, names: Sequence[str] = ()) -> None:
    """Dotted lines at ``marks``, one legend entry ``label`` for them all, and ``names``
    (as many as marks, or none) above the plot on a top axis."""
    for i, mark in enumerate(marks):
        ax.axvline(
            mark, color="black", linewidth=0.6, linestyle=":", label=label if i == 0 else "_mark"
        )
    if marks and names:
        stride = math.ceil(len(marks) / _MAX_NAMES)
        top = ax.secondary_xaxis("top")
        top.set_xticks(list(marks)[::stride], labels=list(names)[::stride])
        top.tick_params(labelsize="x-small", length=2, pad=1)


def _integer_ticks(axis: Any) -> None:
    """Ticks of ``axis`` at whole numbers only (device counts, steps)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _draw_allocation(ax: Any, run: Allocation, *, pad: float, mark_label: str) -> None:
    if run.times:
        names = list(run.devices)
        ax.stackplot(
            [*run.times, run.stop(pad)],
            *[[*run.devices[n], run.devices[n][-1]] for n in names],
            labels=names,
            colors=[color_of(n) for n in names],
            step="post",
        )
    if run.warmup is not None:
        ax.axvspan(
            *run.warmup,
            facecolor="white",
            edgecolor="0.3",
            hatch="//",
            alpha=0.35,
            linewidth=0.0,
            label="warm-up (not measured)",
        )
    _marks(ax, run.marks, label=mark_label, names=run.mark_names)
    _integer_ticks(ax.yaxis)


def allocation_timeline(
    path: str | Path,
    times: Sequence[float],
    devices: Mapping[str, Sequence[float]],
    *,
    marks: Sequence[float] = (),
    mark_names: Sequence[str] = (),
    mark_label: str = "iteration start",
    warmup: tuple[float, float] | None = None,
    end: float | None = None,
    xlim: tuple[float, float] | None = None,
    title: str = "",
    ylabel: str = "devices",
) -> Path:
    """Stacked steps of ``devices[name][i]`` from ``times[i]`` on, the last one until
    ``end`` (when the run ended; without it, or when it is not after the last time, the
    last step is extended a little so it shows); dotted vertical lines at ``marks``
    (iteration starts: ``mark_label`` in the legend, ``mark_names`` above the plot), the
    ``warmup`` span shaded; the time axis spans ``xlim`` (several charts drawn to be
    compared), else the run.
    """
    run = Allocation(
        times=times, devices=devices, end=end, marks=marks, mark_names=mark_names, warmup=warmup
    )
    with _figure(path) as (_, (ax,)):
        pad = max(1.0, 0.02 * (times[-1] - times[0])) if times else 1.0
        _draw_allocation(ax, run, pad=pad, mark_label=mark_label)
        if xlim is not None or times:
            ax.set_xlim(*(xlim or (times[0], run.stop(pad))))
        _legend_outside(ax)
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
    mark_label: str = "iteration start",
    step: bool = False,
    ylim: tuple[float, float] | None = None,
) -> Path:
    """One line per ``series[name] = (xs, ys)``; ``step`` draws post-steps (gauges);
    dotted lines at ``marks``, ``mark_label`` in the legend."""
    with _figure(path) as (_, (ax,)):
        for name, (xs, ys) in series.items():
            _check(name, xs, ys)
            if step:
                ax.step(xs, ys, where="post", label=name, color=color_of(name))
            else:
                ax.plot(
                    xs, ys, label=name, color=color_of(name), marker="." if len(xs) < 40 else ""
                )
        _marks(ax, marks, label=mark_label)
        if ylim is not None:
            ax.set_ylim(*ylim)
        _legend_outside(ax)
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
    mark_label: str = "move",
) -> Path:
    """One panel per ``series[name] = (times, predicted, measured)``: the prediction
    dashed, the measurement solid; dotted lines at ``marks``, ``mark_label`` in the
    legend."""
    rows = max(1, len(series))
    with _figure(path, rows=rows, size=(9.0, 2.6), sharex=True) as (fig, axes):
        for ax, (name, (times, predicted, measured)) in zip(axes, series.items(), strict=False):
            _check(f"{name} predicted", times, predicted)
            _check(f"{name} measured", times, measured)
            color = color_of(name)
            ax.step(times, measured, where="post", color=color, label=f"{name} measured")
            ax.step(times, predicted, where="post", color=color, linestyle="--", label="predicted")
            _marks(ax, marks, label=mark_label)
            ax.set_ylabel(ylabel)
            _legend_outside(ax)
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
    runs: Mapping[str, Allocation],
    *,
    title: str = "",
    ylabel: str = "devices",
    mark_label: str = "iteration start",
) -> Path:
    """One panel per ``runs[label]`` (stacked steps as in :func:`allocation_timeline`),
    every panel on the same time axis, one legend for all; each run's area ends at its
    own end, so a shorter run looks shorter."""
    rows = max(1, len(runs))
    longest = max((run.stop(0.0) for run in runs.values() if run.times), default=1.0)
    pad = 0.02 * max(longest, 1.0)
    right = max((run.stop(pad) for run in runs.values() if run.times), default=1.0)
    left = min((min(0.0, run.times[0]) for run in runs.values() if run.times), default=0.0)
    entries: dict[str, Any] = {}
    with _figure(path, rows=rows, size=(9.0, 2.4), sharex=True) as (fig, axes):
        for ax, (label, run) in zip(axes, runs.items(), strict=False):
            _draw_allocation(ax, run, pad=pad, mark_label=mark_label)
            handles, labels = ax.get_legend_handles_labels()
            entries.update(zip(labels, handles, strict=True))
            ax.set_xlim(left, right)
            ax.set_ylabel(ylabel)
            ax.set_title(label, fontsize="medium")
        _legend_outside(axes[0], entries)
        axes[-1].set_xlabel("time (s)")
        fig.suptitle(title)
    return Path(path)


def line_panels(
    path: str | Path,
    panels: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
    *,
    xlabel: str = "step",
    integer_x: bool = False,
    title: str = "",
) -> Path:
    """One panel per ``panels[quantity]``, one line per ``panels[quantity][run] = (xs,
    ys)``; the panel's y label is the quantity; ``integer_x``: ticks at whole x values
    only (steps)."""
    rows = max(1, len(panels))
    with _figure(path, rows=rows, size=(9.0, 2.6), sharex=True) as (fig, axes):
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
            if integer_x:
                _integer_ticks(ax.xaxis)
            _legend_outside(ax)
        axes[-1].set_xlabel(xlabel)
        fig.suptitle(title)
    return Path(path)


def sweep_chart(
    path: str | Path,
    values: Sequence[float | str],
    panels: Mapping[str, Mapping[str, Sequence[float]]],
    *,
    xlabel: str,
    levels: Mapping[str, float] | None = None,
    title: str = "",
) -> Path:
    """One panel per ``panels[figure]``, one line per ``panels[figure][run]`` (a y per
    value), against the swept ``values``: at their own positions when all are numbers,
    else evenly spaced; a tick at each value; a run keeps its colour in every panel.
    ``levels[figure]``: a grey dashed line at that height (1 in a ratio's panel).
    """
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    xs = [float(v) for v in values] if numeric else [float(i) for i in range(len(values))]
    names = [f"{v:g}" if numeric else str(v) for v in values]
    runs = list(dict.fromkeys(name for series in panels.values() for name in series))
    rows = max(1, len(panels))
    with _figure(path, rows=rows, size=(7.0, 2.4), sharex=True) as (fig, axes):
        for ax, (figure, series) in zip(axes, panels.items(), strict=False):
            for name, ys in series.items():
                _check(f"{figure}/{name}", xs, ys)
                index = runs.index(name)
                color = _RUN_COLORS[index % len(_RUN_COLORS)]
                ax.plot(xs, ys, label=name, color=color, marker="ox^sv"[index % 5])
            if levels and figure in levels:
                ax.axhline(levels[figure], color="0.5", linewidth=0.8, linestyle="--")
            ax.set_ylabel(figure)
            _legend_outside(ax)
        axes[-1].set_xticks(xs, labels=names)
        axes[-1].set_xlabel(xlabel)
        fig.suptitle(title)
    return Path(path)
