"""A :class:`~dynarl.sched._summary.LedgerSummary` as text (for a terminal) or JSON.

:func:`format_summary` prints two header lines — what the ledger holds (its file's lines
by kind, a run of holds as one line of several rounds; or, not read from a file, its
records by kind), then its span, rounds and moves — and sections in a fixed order — moves,
migrations, gain, prediction error, components, iterations, rounds without a move,
rejected candidates, safe mode, notes — skipping empty ones. A ledger without records is
one sentence instead: an empty file, or one cut off in its first record.
:func:`summary_json` is the same content as one
JSON document; numbers that are not finite (a gain of "all remaining work") are ``null``.
Pure; runs anywhere.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from dynarl.sched._summary import Distribution, IterationSpan, LedgerSummary, MoveSummary

__all__ = ["format_summary", "summary_json"]


def summary_json(summary: LedgerSummary, *, source: str = "") -> str:
    """The summary as an indented JSON document (``source``: where the ledger came from)."""
    document = {"source": source, **asdict(summary)} if source else asdict(summary)
    return json.dumps(_finite(document), indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def format_summary(summary: LedgerSummary, *, source: str = "") -> str:
    """The summary as text, one section per aspect (see the module docstring); a ledger
    without records is one sentence saying so."""
    s = summary
    name = source or "the ledger"
    if not s.num_records:
        return _no_records(s, name)
    span = s.end - s.start
    lines = [
        f"ledger {name}: {_contents(s)}",
        f"over {span:.1f} s (clock {s.start:.1f} to {s.end:.1f} s; times below are from "
        f"the first record): {_plural(s.num_rounds, 'decision round')}, "
        f"{_plural(s.num_committed, 'committed move')}"
        + (f", {_plural(s.operator_moves, 'operator move')}" if s.operator_moves else ""),
    ]
    for section in (
        _moves(s),
        _migrations(s),
        _gain(s),
        _errors(s),
        _components(s),
        _iterations(s),
        _reasons("Rounds without a move, by reason", s.rounds_by_reason),
        _reasons("Rejected candidates, by reason", s.rejected_by_reason),
        _safe_mode(s),
        ["Notes"] + [f"  - {note}" for note in s.notes] if s.notes else [],
    ):
        if section:
            lines += ["", *section]
    return "\n".join(lines)


_KIND_WORDS = {
    "decision": "decision",
    "migration": "migration",
    "safety": "safe-mode transition",
    "observation": "observation",
    "graph": "graph finding",
}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _contents(s: LedgerSummary) -> str:
    """What the ledger holds: its file's lines by kind, or (not read from a file) its
    records by kind."""
    if s.file is None:
        kinds = ", ".join(_plural(n, _KIND_WORDS[k]) for k, n in s.records_by_kind.items())
        return f"{_plural(s.num_records, 'record')}: {kinds}"
    f = s.file
    kinds = ", ".join(
        _plural(n, "hold run") + f" ({_plural(f.num_run_rounds, 'hold')})"
        if kind == "rounds"
        else _plural(n, _KIND_WORDS[kind])
        for kind, n in f.lines_by_kind.items()
    )
    if f.num_updates:
        kinds += (
            f", {_plural(f.num_updates, 'update')} (a record written again, its realised "
            "effect filled in)"
        )
    torn = (
        f"; a torn last line of {f.skipped_bytes} bytes skipped (the job stopped mid-write)"
        if f.skipped_bytes
        else ""
    )
    return f"{_plural(f.num_lines, 'line')}: {kinds}{torn}"


def _no_records(s: LedgerSummary, name: str) -> str:
    """The one sentence for a ledger without records."""
    f = s.file
    if f is not None and f.skipped_bytes and not f.num_lines:
        return (
            f"{name} holds no complete record: its only line was cut off after "
            f"{f.skipped_bytes} bytes (the job stopped while writing its first record)"
        )
    if f is not None and not f.num_lines:
        return (
            f"{name} is empty: no records were written (the job wrote nothing, or not to this file)"
        )
    return f"{name} holds no records"


def _table(title: str, header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Aligned columns: the first ``left`` to the left, the others (numbers) to the right."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i < left else f"{{:>{w}}}" for i, w in enumerate(widths))
    return [title, "  " + fmt.format(*header).rstrip()] + [
        "  " + fmt.format(*r).rstrip() for r in rows
    ]


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _seconds(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "all" if value > 0 else "-inf"
    return f"{value:+.2f} s" if signed else f"{value:.2f} s"


def _percent(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return "0%" if round(value * 100) == 0 else f"{value * 100:+.0f}%"


def _change(move: MoveSummary) -> str:
    names = sorted(set(move.old_allocation) | set(move.new_allocation))
    parts = []
    for name in names:
        old, new = move.old_allocation.get(name, 0), move.new_allocation.get(name, 0)
        if old != new:
            parts.append(f"{name} {old}->{new}")
    return ", ".join(parts) or "no change"


def _moves(s: LedgerSummary) -> list[str]:
    rows = [
        [
            m.decision_id,
            f"{m.time - s.start:.1f} s",
            _change(m),
            _seconds(m.predicted_gain_s),
            _seconds(m.predicted_cost_s),
            _bytes(m.predicted_bytes),
            _bytes(m.bytes_moved),
            _seconds(m.pause_s),
            str(m.cache_loss_tokens),
            _seconds(m.realised_gain_s, signed=True),
            _percent(m.prediction_error),
            m.status,
        ]
        for m in s.moves
    ]
    header = [
        "move",
        "time",
        "change",
        "pred gain",
        "pred cost",
        "pred bytes",
        "bytes",
        "pause",
        "cache loss",
        "realised gain",
        "error",
        "status",
    ]
    title = "Moves (gain: iteration time saved; error: realised/predicted - 1)"
    return _table(title, header, rows, left=3)


def _migrations(s: LedgerSummary) -> list[str]:
    rows = [
        [
            m.kind,
            m.component,
            str(m.committed),
            str(m.rolled_back),
            str(m.failed),
            _bytes(m.bytes_moved),
            _seconds(m.pause_total_s),
            _seconds(m.pause_max_s),
            str(m.cache_loss_tokens),
        ]
        for m in s.migrations
    ]
    header = [
        "kind",
        "component",
        "committed",
        "rolled back",
        "failed",
        "bytes",
        "pause total",
        "pause max",
        "cache loss",
    ]
    table = _table("Migrations by kind and component", header, rows, left=2)
    if table:
        table.append(
            f"  total: {_bytes(s.bytes_moved)} moved, {s.pause_total_s:.2f} s of pauses, "
            f"{s.cache_loss_tokens} cached tokens lost"
        )
    return table


def _gain(s: LedgerSummary) -> list[str]:
    measured = [m for m in s.moves if m.status == "measured"]
    if not s.moves:
        return []
    return [
        "Gain",
        f"  {len(measured)} of {len(s.moves)} moves measured: predicted "
        f"{_seconds(s.predicted_gain_s)}, realised {_seconds(s.realised_gain_s, signed=True)} "
        "(realised: the old allocation's predicted finish minus the measured finish)",
    ]


def _dist(d: Distribution | None) -> str:
    if d is None:
        return "no samples"
    return (
        f"n={d.count} median {_percent(d.median)} (|median| {d.median_abs * 100:.0f}%), "
        f"p10 {_percent(d.p10)}, p90 {_percent(d.p90)}, range {_percent(d.min)} to "
        f"{_percent(d.max)}"
    )


def _errors(s: LedgerSummary) -> list[str]:
    if not (s.moves or s.components):
        return []
    return [
        "Prediction error",
        f"  moves (realised/predicted remaining - 1): {_dist(s.prediction_error)}",
        *(
            f"  {c.component} throughput ((predicted - measured)/measured): "
            f"{_dist(c.throughput_error)}"
            for c in s.components
        ),
    ]


def _components(s: LedgerSummary) -> list[str]:
    rows = [
        [
            c.component,
            f"{c.mean_devices:.1f}",
            f"{c.mean_utilization:.2f}",
            f"{c.mean_queue_depth:.1f}",
            f"{c.mean_throughput:.3g}",
            f"{c.mean_predicted_throughput:.3g}",
        ]
        for c in s.components
    ]
    header = ["component", "devices", "utilization", "queue", "throughput", "predicted"]
    return _table("Components (means over the decision rounds)", header, rows)


def _iterations(s: LedgerSummary) -> list[str]:
    rows = [
        [
            str(i.iteration),
            f"{i.start - s.start:.1f} s",
            f"{i.end - s.start:.1f} s",
            _duration(i),
            str(i.num_rounds),
            str(i.moves),
        ]
        for i in s.iterations
    ]
    header = ["iteration", "start", "end", "duration", "rounds", "moves"]
    return _table("Iterations", header, rows)


def _duration(i: IterationSpan) -> str:
    if not i.num_rounds:  # between two rounds: shorter than their interval
        return f"< {i.end - i.start:.1f} s"
    return f"{i.end - i.start:.1f} s" + ("" if i.complete else " (open)")


def _reasons(title: str, counts: Mapping[str, int]) -> list[str]:
    return [title] + [f"  {n:6d}  {reason}" for reason, n in counts.items()] if counts else []


def _safe_mode(s: LedgerSummary) -> list[str]:
    lines = [f"Safe mode: {s.safe_mode_s:.1f} s in {len(s.safe_mode)} episode(s)"]
    for e in s.safe_mode:
        end = f"{e.end - s.start:.1f} s" if e.end is not None else "end of ledger"
        who = " (operator)" if e.operator else ""
        lines.append(f"  {e.start - s.start:.1f} s to {end}: {e.reason}{who}")
    return lines
