"""A ledger as time series, and the charts ``dynarl events --plot`` draws from them.

:func:`ledger_series` (pure) lines the decision rounds up on one time axis: the devices
each component held (from the decision records), its utilization, measured and predicted
throughput (from the round observations, NaN where a component had not reported), the
iteration starts, the committed moves, and for every measured move its predicted and
realised remaining iteration time. :func:`plot_ledger` draws them with :mod:`dynarl.plots`.
Runs anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dynarl import plots
from dynarl.bus import DecisionRecord
from dynarl.sched._ledger import LedgerRecord
from dynarl.sched._ledger_records import ObservationRecord

__all__ = ["LedgerSeries", "ledger_series", "plot_ledger"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerSeries:
    """Per-round series of one ledger (see the module docstring)."""

    origin: float
    """Clock time of the ledger's first record; every time below is seconds after it (as
    the summary's)."""
    times: tuple[float, ...]
    devices: Mapping[str, tuple[float, ...]]
    """Devices per component at each round, plus ``free`` when the ledger knows it."""
    utilization: Mapping[str, tuple[float, ...]]
    throughput: Mapping[str, tuple[float, ...]]
    """Measured items per second."""
    predicted: Mapping[str, tuple[float, ...]]
    """The predictor's items per second on the devices held."""
    iteration_starts: tuple[float, ...]
    move_times: tuple[float, ...]
    move_labels: tuple[str, ...]
    """Decision ids of the measured moves."""
    predicted_remaining_s: tuple[float, ...]
    """Per measured move: the remaining iteration time its decision predicted, cost included."""
    realised_remaining_s: tuple[float, ...]
    """Per measured move: the remaining iteration time measured."""


def ledger_series(records: Iterable[LedgerRecord]) -> LedgerSeries:
    """The series of ``records`` (one ledger; the last version per id)."""
    ordered = sorted(records, key=lambda r: r.time)
    rounds = [r for r in ordered if isinstance(r, DecisionRecord)]
    seen = {r.record_id: r for r in ordered if isinstance(r, ObservationRecord)}
    names = sorted({n for r in rounds for n in r.old_allocation})
    observed = [seen.get(r.decision_id) for r in rounds]
    devices = {n: tuple(float(r.old_allocation.get(n, 0)) for r in rounds) for n in names}
    if rounds and all(o is not None for o in observed):
        devices["free"] = tuple(float(o.num_free) for o in observed if o is not None)
    starts: dict[int, float] = {}
    for obs in seen.values():
        if obs.components:
            starts.setdefault(max(c.iteration for c in obs.components.values()), obs.time)
    first = min(starts) if starts else 0
    origin = ordered[0].time if ordered else 0.0
    measured = [r for r in rounds if r.committed and r.prediction_error is not None]
    predicted = [_predicted_remaining(r) for r in measured]
    return LedgerSeries(
        origin=origin,
        times=tuple(r.time - origin for r in rounds),
        devices=devices,
        utilization=_field(observed, names, "utilization"),
        throughput=_field(observed, names, "throughput"),
        predicted=_field(observed, names, "predicted_throughput"),
        iteration_starts=tuple(t - origin for i, t in sorted(starts.items()) if i != first),
        move_times=tuple(r.time - origin for r in rounds if r.committed),
        move_labels=tuple(r.decision_id for r in measured),
        predicted_remaining_s=tuple(predicted),
        realised_remaining_s=tuple(
            p * (1.0 + (r.prediction_error or 0.0))
            for p, r in zip(predicted, measured, strict=True)
        ),
    )


def _predicted_remaining(record: DecisionRecord) -> float:
    rate = record.predicted_throughput_new
    return (1.0 / rate if rate > 0 else math.inf) + record.migration_cost_s


def _field(
    observed: list[ObservationRecord | None], names: list[str], name: str
) -> dict[str, tuple[float, ...]]:
    out = {}
    for component in names:
        values = []
        for obs in observed:
            seen = obs.components.get(component) if obs is not None else None
            values.append(float(getattr(seen, name)) if seen is not None else math.nan)
        if any(not math.isnan(v) for v in values):
            out[component] = tuple(values)
    return out


def plot_ledger(
    records: Iterable[LedgerRecord], directory: str | Path, *, title: str = ""
) -> list[Path]:
    """Draw ``allocation.png``, ``utilization.png``, ``throughput.png`` and, when a move
    was measured, ``moves.png`` into ``directory``; returns their paths."""
    s = ledger_series(records)
    out = Path(directory)
    label = f"{title}: " if title else ""
    marks = s.iteration_starts
    paths = [
        plots.allocation_timeline(
            out / "allocation.png",
            s.times,
            s.devices,
            marks=marks,
            title=f"{label}devices per component",
        ),
        plots.line_chart(
            out / "utilization.png",
            {name: (s.times, values) for name, values in s.utilization.items()},
            ylabel="utilization",
            title=f"{label}utilization per component",
            marks=marks,
            step=True,
            ylim=(0.0, 1.05),
        ),
        plots.predicted_vs_measured(
            out / "throughput.png",
            {
                n: (s.times, s.predicted[n], s.throughput[n])
                for n in s.throughput
                if n in s.predicted
            },
            title=f"{label}predicted vs measured throughput",
            marks=s.move_times,
            mark_label="move",
        ),
    ]
    if s.move_labels:
        paths.append(
            plots.parity_chart(
                out / "moves.png",
                s.predicted_remaining_s,
                s.realised_remaining_s,
                labels=s.move_labels,
                title=f"{label}remaining iteration time per move",
            )
        )
    return paths
