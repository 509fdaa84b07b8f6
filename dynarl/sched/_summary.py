"""A run's ledger, summarised: what moved, what it cost, what it gained, what was refused.

:func:`summarise_ledger` is a pure function of the records (a :class:`Ledger` or any
iterable of :data:`LedgerRecord`) returning a frozen :class:`LedgerSummary`:

- every committed move with its predicted gain, cost and bytes, its migrations' measured
  bytes, pause and cache loss, and — once its iteration ended — its realised gain and
  prediction error (see :mod:`dynarl.sched._effects` for what is measured and how);
- migrations by kind and component (committed, rolled back, failed, bytes, pauses);
- the distribution of the moves' prediction errors, and of each component's throughput
  prediction against the measured throughput at every round;
- rounds that did not commit, and candidates that were rejected, grouped by their reason's
  category (its type, without numbers and ids: "saves 0.3 s" and "saves 0.5 s" count
  together);
- time in safe mode (episodes from the safe-mode records);
- iterations and per-component utilization and devices from the round observations;
- the records of each kind and, for a ledger read from a file, what its lines held
  (:class:`~dynarl.sched._ledger_file.LedgerFile`).

A round observation records the iteration its components reported, so an iteration that
began and ended between two decision rounds is seen by none; iterations are numbered one
after another, so every number between two seen ones is listed too, bounded by the rounds
around it.

:mod:`dynarl.sched._summary_format` renders it as text or JSON. Pure; runs anywhere.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import get_args

import numpy as np

from dynarl.bus import (
    CandidateReason,
    DecisionReason,
    DecisionRecord,
    MigrationRecord,
    MoveInFlight,
)
from dynarl.sched._ledger import Ledger, LedgerRecord, RecordKind, record_kind
from dynarl.sched._ledger_file import LedgerFile
from dynarl.sched._ledger_records import ObservationRecord, SafeModeRecord

__all__ = [
    "ComponentUsage",
    "Distribution",
    "IterationSpan",
    "LedgerSummary",
    "MigrationStats",
    "MoveSummary",
    "SafeModeEpisode",
    "reason_category",
    "summarise_ledger",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Distribution:
    """Order statistics of a sample of (signed) values."""

    count: int
    mean: float
    median: float
    p10: float
    p90: float
    min: float
    max: float
    median_abs: float
    """Median of the absolute values (the scheduler's own error measure)."""

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution | None:
        """The distribution of the finite ``values`` (None when there are none)."""
        data = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
        if data.size == 0:
            return None
        p10, median, p90 = np.percentile(data, [10, 50, 90])
        return cls(
            count=int(data.size),
            mean=float(data.mean()),
            median=float(median),
            p10=float(p10),
            p90=float(p90),
            min=float(data.min()),
            max=float(data.max()),
            median_abs=float(np.median(np.abs(data))),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class MoveSummary:
    """One committed decision and what became of it."""

    decision_id: str
    time: float
    reason: str
    """The decision's reason, as its sentence."""
    donor: str | None
    receivers: tuple[str, ...]
    old_allocation: Mapping[str, int]
    new_allocation: Mapping[str, int]
    predicted_bottleneck: str | None
    predicted_gain_s: float
    """Net of the predicted cost; infinite when the old allocation could not finish."""
    predicted_cost_s: float
    predicted_bytes: int
    status: str
    """``measured``, ``failed``, ``superseded`` (a later move came first) or ``open``."""
    realised_gain_s: float | None = None
    """The old allocation's predicted remaining time minus the measured one."""
    prediction_error: float | None = None
    """Measured remaining time over the predicted one, minus 1."""
    migrations: tuple[str, ...] = ()
    """``kind:component:outcome`` of each migration carried out for it."""
    bytes_moved: int = 0
    pause_s: float = 0.0
    """Longest pause among its migrations (they run concurrently), seconds."""
    cache_loss_tokens: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class MigrationStats:
    """Migrations of one kind of one component."""

    kind: str
    component: str
    committed: int = 0
    rolled_back: int = 0
    failed: int = 0
    bytes_moved: int = 0
    pause_total_s: float = 0.0
    pause_max_s: float = 0.0
    cache_loss_tokens: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class SafeModeEpisode:
    """One stretch of safe mode."""

    start: float
    end: float | None
    """None: still in safe mode at the end of the ledger."""
    reason: str
    operator: bool
    duration_s: float
    """Until ``end``, or until the ledger's last record."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IterationSpan:
    """An iteration as the round observations saw it."""

    iteration: int
    start: float
    """The first round that saw it; for one no round saw, the last round before it."""
    end: float
    """The next iteration's ``start`` (the last observation for the last iteration): the
    first round that saw a later iteration, or the last round that saw this one when the
    next is one no round saw."""
    complete: bool
    """Whether a later iteration was seen (else ``end`` is the last observation)."""
    moves: int
    """Committed moves decided in the rounds that saw it."""
    num_rounds: int
    """Decision rounds that saw it; 0: it began and ended between two rounds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ComponentUsage:
    """One component over the rounds observed."""

    component: str
    mean_devices: float
    mean_utilization: float
    mean_queue_depth: float
    mean_throughput: float
    """Measured items per second."""
    mean_predicted_throughput: float
    throughput_error: Distribution | None
    """(predicted − measured) / measured over rounds where both are positive."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerSummary:
    """Everything :func:`summarise_ledger` found (see the module docstring)."""

    start: float
    end: float
    num_rounds: int
    num_committed: int
    num_records: int
    """Records, each id once (the last version), a run of rounds as its rounds."""
    records_by_kind: Mapping[str, int]
    """``num_records`` by kind (``decision``, ``migration``, ``safety``, ``observation``,
    ``graph``; kinds with none left out)."""
    moves: tuple[MoveSummary, ...]
    migrations: tuple[MigrationStats, ...]
    operator_moves: int
    """Migrated decisions without a decision record (moves ordered through ``Job.move``)."""
    rounds_by_reason: Mapping[str, int]
    rejected_by_reason: Mapping[str, int]
    prediction_error: Distribution | None
    predicted_gain_s: float
    """Sum over measured moves."""
    realised_gain_s: float
    """Sum over measured moves."""
    safe_mode: tuple[SafeModeEpisode, ...]
    safe_mode_s: float
    iterations: tuple[IterationSpan, ...]
    components: tuple[ComponentUsage, ...]
    bytes_moved: int = 0
    pause_total_s: float = 0.0
    cache_loss_tokens: int = 0
    notes: tuple[str, ...] = field(default=())
    file: LedgerFile | None = None
    """What the ledger's file held, line by line (None: not read from a file)."""


def reason_category(reason: DecisionReason | CandidateReason) -> str:
    """What the summary counts ``reason`` under: its category, by its type.

    ``MinimumInterval(wait_s=1.5)`` → ``"hold: minimum interval between moves"``;
    ``SavesLess(gain_s=0.2, chosen_gain_s=0.3)`` → ``"saves # s, less than the chosen # s"``.
    """
    return reason.category


def summarise_ledger(
    records: Iterable[LedgerRecord], *, file: LedgerFile | None = None
) -> LedgerSummary:
    """Summarise a ledger's records (the last version per id, in any order); ``file``: what
    their file held (default: :attr:`Ledger.file` when ``records`` is a loaded ledger)."""
    if file is None and isinstance(records, Ledger):
        file = records.file
    ordered = sorted(records, key=lambda r: r.time)
    decisions = [r for r in ordered if isinstance(r, DecisionRecord)]
    migrations = [r for r in ordered if isinstance(r, MigrationRecord)]
    observations = [r for r in ordered if isinstance(r, ObservationRecord)]
    safety = [r for r in ordered if isinstance(r, SafeModeRecord)]
    start = ordered[0].time if ordered else 0.0
    end = ordered[-1].time if ordered else 0.0
    moves = _moves(decisions, migrations)
    measured = [m for m in moves if m.status == "measured"]
    episodes = _episodes(safety, end)
    decided = {d.decision_id for d in decisions}
    iterations = _iterations(observations, moves)
    return LedgerSummary(
        start=start,
        end=end,
        num_rounds=len(decisions),
        num_committed=len(moves),
        num_records=len(ordered),
        records_by_kind=_by_kind(ordered),
        moves=tuple(moves),
        migrations=_migration_stats(migrations),
        operator_moves=len({m.decision_id for m in migrations} - decided),
        rounds_by_reason=_count(reason_category(d.reason) for d in decisions if not d.committed),
        rejected_by_reason=_count(reason_category(c.reason) for d in decisions for c in d.rejected),
        prediction_error=Distribution.of(
            [m.prediction_error for m in moves if m.prediction_error is not None]
        ),
        predicted_gain_s=sum(m.predicted_gain_s for m in measured),
        realised_gain_s=sum(m.realised_gain_s or 0.0 for m in measured),
        safe_mode=episodes,
        safe_mode_s=sum(e.duration_s for e in episodes),
        iterations=iterations,
        components=_usage(observations),
        bytes_moved=sum(m.bytes_moved for m in migrations),
        pause_total_s=sum(m.pause_s for m in migrations),
        cache_loss_tokens=sum(m.cache_loss_tokens for m in migrations),
        notes=_notes(moves, observations, iterations),
        file=file,
    )


def _by_kind(records: Sequence[LedgerRecord]) -> dict[str, int]:
    counts = Counter(record_kind(r) for r in records)
    return {k: counts[k] for k in get_args(RecordKind) if counts[k]}


def _count(reasons: Iterable[str]) -> dict[str, int]:
    return dict(Counter(reasons).most_common())


def _moves(
    decisions: Sequence[DecisionRecord], migrations: Sequence[MigrationRecord]
) -> list[MoveSummary]:
    by_decision: dict[str, list[MigrationRecord]] = defaultdict(list)
    for m in migrations:
        by_decision[m.decision_id].append(m)
    committed = [d for d in decisions if d.committed]
    after = {d.decision_id: decisions[i + 1 :] for i, d in enumerate(decisions) if d.committed}
    out = []
    for index, d in enumerate(committed):
        mine = by_decision.get(d.decision_id, [])
        failed = any(m.outcome != "committed" for m in mine)
        if failed or (not mine and _not_applied(d, after[d.decision_id])):
            status = "failed"
        elif d.realised_iteration_delta_s is not None or d.prediction_error is not None:
            status = "measured"
        else:
            status = "superseded" if index + 1 < len(committed) else "open"
        delta = d.realised_iteration_delta_s
        out.append(
            MoveSummary(
                decision_id=d.decision_id,
                time=d.time,
                reason=str(d.reason),
                donor=d.donor,
                receivers=d.receivers,
                old_allocation=d.old_allocation,
                new_allocation=d.new_allocation,
                predicted_bottleneck=d.predicted_bottleneck,
                predicted_gain_s=d.expected_gain_s,
                predicted_cost_s=d.migration_cost_s,
                predicted_bytes=d.migration_bytes,
                status=status,
                realised_gain_s=-delta if delta is not None else None,
                prediction_error=d.prediction_error,
                migrations=tuple(f"{m.kind}:{m.component}:{m.outcome}" for m in mine),
                bytes_moved=sum(m.bytes_moved for m in mine),
                pause_s=max((m.pause_s for m in mine), default=0.0),
                cache_loss_tokens=sum(m.cache_loss_tokens for m in mine),
            )
        )
    return out


def _not_applied(decision: DecisionRecord, later: Sequence[DecisionRecord]) -> bool:
    """Whether the first round after the move's end still had the old allocation (a move
    that failed without migration records, e.g. one that could not be submitted)."""
    for r in later:
        if isinstance(r.reason, MoveInFlight):
            continue
        return r.old_allocation != decision.new_allocation
    return False


def _migration_stats(migrations: Sequence[MigrationRecord]) -> tuple[MigrationStats, ...]:
    groups: dict[tuple[str, str], list[MigrationRecord]] = defaultdict(list)
    for m in migrations:
        groups[(m.kind, m.component)].append(m)
    out = []
    for (kind, component), group in sorted(groups.items()):
        outcomes = Counter(m.outcome for m in group)
        out.append(
            MigrationStats(
                kind=kind,
                component=component,
                committed=outcomes["committed"],
                rolled_back=outcomes["rolled_back"],
                failed=sum(n for o, n in outcomes.items() if o not in ("committed", "rolled_back")),
                bytes_moved=sum(m.bytes_moved for m in group),
                pause_total_s=sum(m.pause_s for m in group),
                pause_max_s=max(m.pause_s for m in group),
                cache_loss_tokens=sum(m.cache_loss_tokens for m in group),
            )
        )
    return tuple(out)


def _episodes(records: Sequence[SafeModeRecord], end: float) -> tuple[SafeModeEpisode, ...]:
    out: list[SafeModeEpisode] = []
    opened: SafeModeRecord | None = None
    for r in records:
        if r.safe and opened is None:
            opened = r
        elif not r.safe and opened is not None:
            out.append(_episode(opened, r.time))
            opened = None
    if opened is not None:
        out.append(_episode(opened, None, end))
    return tuple(out)


def _episode(opened: SafeModeRecord, closed: float | None, end: float = 0.0) -> SafeModeEpisode:
    stop = closed if closed is not None else max(end, opened.time)
    return SafeModeEpisode(
        start=opened.time,
        end=closed,
        reason=opened.reason,
        operator=opened.operator,
        duration_s=stop - opened.time,
    )


def _iterations(
    observations: Sequence[ObservationRecord], moves: Sequence[MoveSummary]
) -> tuple[IterationSpan, ...]:
    """Every iteration from the first seen to the last (see the module docstring)."""
    seen: dict[int, list[float]] = defaultdict(list)
    for obs in observations:
        if obs.components:
            seen[max(c.iteration for c in obs.components.values())].append(obs.time)
    if not seen:
        return ()
    numbers = sorted(seen)
    last = observations[-1].time
    out = []
    for index, iteration in enumerate(numbers):
        times = seen[iteration]
        complete = index + 1 < len(numbers)
        stop = seen[numbers[index + 1]][0] if complete else last
        begin = times[0]
        num = sum(1 for m in moves if begin <= m.time < stop or (not complete and m.time >= begin))
        gap = complete and numbers[index + 1] > iteration + 1
        out.append(
            IterationSpan(
                iteration=iteration,
                start=begin,
                end=times[-1] if gap else stop,
                complete=complete,
                moves=num,
                num_rounds=len(times),
            )
        )
        unseen = range(iteration + 1, numbers[index + 1] if complete else iteration + 1)
        out += [
            IterationSpan(
                iteration=n, start=times[-1], end=stop, complete=True, moves=0, num_rounds=0
            )
            for n in unseen
        ]
    return tuple(out)


def _usage(observations: Sequence[ObservationRecord]) -> tuple[ComponentUsage, ...]:
    names = sorted({name for obs in observations for name in obs.components})
    out = []
    for name in names:
        seen = [obs.components[name] for obs in observations if name in obs.components]
        errors = [
            (c.predicted_throughput - c.throughput) / c.throughput
            for c in seen
            if c.throughput > 0 and c.predicted_throughput > 0
        ]
        out.append(
            ComponentUsage(
                component=name,
                mean_devices=float(np.mean([c.devices for c in seen])),
                mean_utilization=float(np.mean([c.utilization for c in seen])),
                mean_queue_depth=float(np.mean([c.queue_depth for c in seen])),
                mean_throughput=float(np.mean([c.throughput for c in seen])),
                mean_predicted_throughput=float(np.mean([c.predicted_throughput for c in seen])),
                throughput_error=Distribution.of(errors),
            )
        )
    return tuple(out)


def _notes(
    moves: Sequence[MoveSummary],
    observations: Sequence[ObservationRecord],
    iterations: Sequence[IterationSpan],
) -> tuple[str, ...]:
    notes = []
    unseen = [str(i.iteration) for i in iterations if not i.num_rounds]
    if unseen:
        notes.append(
            f"no decision round saw iteration(s) {', '.join(unseen)}: each began and ended "
            "between two rounds; its start and end are the rounds around it"
        )
    superseded = sum(m.status == "superseded" for m in moves)
    if superseded:
        notes.append(
            f"{superseded} move(s) superseded by a later move in the same iteration: "
            "their realised effect is not measured"
        )
    if any(m.status == "open" for m in moves):
        notes.append("the last move's iteration had not ended when the ledger ends")
    if not observations:
        notes.append("no round observations in this ledger: it holds no decision round")
    return tuple(notes)
