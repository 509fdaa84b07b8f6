"""The ledger: every decision round and every migration outcome, queryable and on disk.

Records are the bus's :class:`~dynarl.bus.DecisionRecord` and
:class:`~dynarl.bus.MigrationRecord` and the scheduler's own
:class:`~dynarl.sched._ledger_records.SafeModeRecord` and
:class:`~dynarl.sched._ledger_records.ObservationRecord`, and the job's start-up
:class:`~dynarl.sched._ledger_records.GraphFindingRecord`. Each append goes to memory and,
when the ledger has a path, as one JSON line to an append-only file that is flushed at once.
Realised effects (iteration-time change, prediction error) are filled in later by
appending the updated record again; readers keep the last line per id. JSON has no
infinity: a non-finite float (a gain of "all remaining work") is written as the string
``"inf"``, ``"-inf"`` or ``"nan"`` and read back as the float. Listeners (the metrics
exporter) see every append. A long job's ledger keeps its memory bounded with
``keep_recent``: committed decisions, migrations, safe-mode transitions and graph
findings stay in memory, but only the most recent ``keep_recent`` of the other records
(uncommitted rounds and observations, one pair per decision round) do — the file keeps
them all, and :meth:`Ledger.load` reads them back. The file stays lean without losing a
record: consecutive uncommitted decision rounds that differ only in id, time, reason and
predicted throughputs (a job holding round after round) are written as one
:class:`~dynarl.sched.RoundsRecord` line when the run ends — at the next round
that does not join it, every ``max_rounds_per_line`` rounds, at :meth:`Ledger.flush` and
at :meth:`Ledger.close` — and :meth:`Ledger.load` expands it back into the very rounds
(a ledger without such lines reads the same way). Memory and listeners see every
round at once. Reasons are written as their tagged structs; :meth:`Ledger.load` also
reads ledgers written when reasons were sentences, turning each sentence back into its
struct (see :mod:`dynarl.sched._ledger_legacy`). Runs on the controller, in the
scheduler's loop; appends are small and flushed, not fsynced (the allocation journal is the
runtime's durable record): a crash loses at most the pending run of uncommitted rounds
(``max_rounds_per_line``, 30 by default: half a minute of holds at one round a second)
and the line being written, which :meth:`Ledger.load` skips (see
:mod:`dynarl.sched._ledger_file`, the reader).
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal

import msgspec

from dynarl.bus import DecisionRecord, MigrationRecord
from dynarl.sched._ledger_file import LedgerFile, open_for_append, read_ledger
from dynarl.sched._ledger_records import (
    GraphFindingRecord,
    LedgerRecord,
    ObservationRecord,
    RoundsRecord,
    SafeModeRecord,
    fold_rounds,
    joins_rounds,
)

__all__ = ["Ledger", "LedgerRecord", "RecordKind", "record_kind"]

logger = logging.getLogger(__name__)

RecordKind = Literal["decision", "migration", "safety", "observation", "graph"]
"""How :meth:`Ledger.query` names the record types."""
_ENCODER = msgspec.json.Encoder()


def record_kind(record: LedgerRecord) -> RecordKind:
    """How :meth:`Ledger.query` names ``record``'s type."""
    match record:
        case DecisionRecord():
            return "decision"
        case MigrationRecord():
            return "migration"
        case SafeModeRecord():
            return "safety"
        case ObservationRecord():
            return "observation"
        case GraphFindingRecord():
            return "graph"


def _record_id(record: LedgerRecord) -> str:
    match record:
        case DecisionRecord():
            return record.decision_id
        case MigrationRecord():
            return record.migration_id
        case SafeModeRecord() | ObservationRecord() | GraphFindingRecord():
            return record.record_id


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its name (JSON has none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _encode(record: LedgerRecord | RoundsRecord) -> bytes:
    """One JSON line (without the newline) of ``record``; non-finite floats as strings."""
    return _ENCODER.encode(_finite(msgspec.to_builtins(record)))


class Ledger:
    """Decision and migration records: an in-memory index plus an optional JSONL sink.

    Use as a (sync or async) context manager, or call :meth:`close`. Raises ValueError
    for a record id that is unknown when filling in realised effects, for a
    ``keep_recent`` below 1 or given without a ``path`` (memory would be the only copy),
    and for a ``max_rounds_per_line`` below 1 (1: every round on its own line).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        keep_recent: int | None = None,
        max_rounds_per_line: int = 30,
    ) -> None:
        if keep_recent is not None and (keep_recent < 1 or path is None):
            raise ValueError(
                f"Ledger keep_recent must be >= 1 and needs a path, got {keep_recent!r}"
                f" with path {path!r}"
            )
        if max_rounds_per_line < 1:
            raise ValueError(
                f"Ledger max_rounds_per_line must be >= 1, got {max_rounds_per_line!r}"
            )
        self.keep_recent = keep_recent
        self.max_rounds_per_line = max_rounds_per_line
        self._run: list[DecisionRecord] = []
        """Uncommitted rounds not yet written (each joins the first)."""
        self._records: dict[tuple[str, str], LedgerRecord] = {}
        self._recent: deque[tuple[str, str]] = deque()
        self._listeners: list[Callable[[LedgerRecord], None]] = []
        self._sink: IO[bytes] | None = None
        self.path = Path(path) if path is not None else None
        self.file: LedgerFile | None = None
        """What :meth:`load` read from the file (None for a ledger not loaded)."""
        if self.path is not None:
            self._sink = open_for_append(self.path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Ledger:
        """Read a JSONL ledger back (the last line per id wins); memory only.

        A torn final line (no newline, not JSON: the job stopped mid-write) is skipped, and
        the returned ledger's :attr:`file` says how many bytes it had (``skipped_bytes``)
        and what else the file held. Raises OSError when the file cannot be read,
        ValueError naming the line of a damaged record anywhere else, or saying what the
        file is when it is not a ledger.
        """
        ledger = cls()
        ledger.file = read_ledger(path, ledger._remember)
        return ledger

    def _remember(self, record: LedgerRecord) -> bool:
        """Keep ``record`` in memory; whether it is new (False: it replaces one)."""
        key = (record_kind(record), _record_id(record))
        new = key not in self._records
        if new and self.keep_recent is not None and _evictable(record):
            self._recent.append(key)
            while len(self._recent) > self.keep_recent:
                old = self._recent.popleft()
                if _evictable(self._records[old]):
                    del self._records[old]
        self._records[key] = record
        return new

    def add_listener(self, listener: Callable[[LedgerRecord], None]) -> None:
        """Call ``listener(record)`` after every append (updates included); it must not raise."""
        self._listeners.append(listener)

    def append(self, record: LedgerRecord) -> None:
        """Record ``record`` (replacing an earlier one with the same id) and write it out."""
        self._remember(record)
        if self._sink is not None:
            self._write(record)
        for listener in self._listeners:
            listener(record)

    def _write(self, record: LedgerRecord) -> None:
        """Write ``record`` out, or hold an uncommitted round back in the pending run."""
        if isinstance(record, DecisionRecord):
            if self._run and not joins_rounds(self._run[0], record):
                self.flush()
            if not record.committed:
                self._run.append(record)
                if len(self._run) >= self.max_rounds_per_line:
                    self.flush()
                return
        self._line(record)

    def _line(self, record: LedgerRecord | RoundsRecord) -> None:
        assert self._sink is not None
        self._sink.write(_encode(record) + b"\n")
        self._sink.flush()

    def flush(self) -> None:
        """Write the pending run of uncommitted rounds now (one line; nothing if none)."""
        if self._run and self._sink is not None:
            self._line(fold_rounds(self._run))
        self._run.clear()

    def fill_realised(
        self,
        record_id: str,
        *,
        realised_iteration_delta_s: float | None = None,
        prediction_error: float | None = None,
        kind: Literal["decision", "migration"] = "decision",
    ) -> LedgerRecord:
        """Fill in the measured effect of a decision (or migration) and write it out again.

        Raises ValueError when the ledger has no such record.
        """
        key = (kind, record_id)
        if key not in self._records:
            raise ValueError(f"no {kind} record {record_id!r} in the ledger")
        changes: dict[str, float] = {}
        if realised_iteration_delta_s is not None:
            changes["realised_iteration_delta_s"] = realised_iteration_delta_s
        if prediction_error is not None:
            changes["prediction_error"] = prediction_error
        updated = msgspec.structs.replace(self._records[key], **changes)
        self.append(updated)
        return updated

    def get(self, record_id: str, kind: RecordKind = "decision") -> LedgerRecord:
        """The record with ``record_id``; raises ValueError if there is none."""
        try:
            return self._records[(kind, record_id)]
        except KeyError:
            raise ValueError(f"no {kind} record {record_id!r} in the ledger") from None

    def query(
        self,
        *,
        kind: RecordKind | None = None,
        component: str | None = None,
        since: float | None = None,
        until: float | None = None,
        committed: bool | None = None,
        reason: str | None = None,
    ) -> list[LedgerRecord]:
        """Records matching every given filter, by time.

        ``component`` matches a decision's donor, receivers or predicted bottleneck, a
        migration's component, an observation's components and a graph finding's
        component and edge ends; ``committed`` matches a
        decision's flag and a migration's ``outcome == "committed"`` (other records never
        match it); ``reason`` is a substring of the record's reason (its sentence).
        """
        out = [
            r
            for (k, _), r in self._records.items()
            if (kind is None or k == kind)
            and (since is None or r.time >= since)
            and (until is None or r.time <= until)
            and (component is None or component in _components(r))
            and (committed is None or _committed(r) == committed)
            and (reason is None or reason in str(getattr(r, "reason", "")))
        ]
        return sorted(out, key=lambda r: (r.time, _record_id(r)))

    def __iter__(self) -> Iterator[LedgerRecord]:
        return iter(self.query())

    def __len__(self) -> int:
        return len(self._records)

    def close(self) -> None:
        """Write the pending rounds and close the sink (idempotent)."""
        if self._sink is not None:
            self.flush()
            self._sink.close()
            self._sink = None

    async def aclose(self) -> None:
        """Close the sink (idempotent)."""
        self.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Ledger:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _components(record: LedgerRecord) -> set[str]:
    match record:
        case MigrationRecord():
            return {record.component}
        case DecisionRecord():
            names = {record.donor, record.predicted_bottleneck, *record.receivers}
            return {n for n in names if n is not None}
        case ObservationRecord():
            return set(record.components)
        case GraphFindingRecord():
            return {n for n in (record.component, record.src, record.dst) if n}
        case SafeModeRecord():
            return set()


def _evictable(record: LedgerRecord) -> bool:
    """Whether a bounded ledger may forget ``record`` from memory (it stays on disk)."""
    match record:
        case DecisionRecord():
            return not record.committed
        case ObservationRecord():
            return True
        case MigrationRecord() | SafeModeRecord() | GraphFindingRecord():
            return False


def _committed(record: LedgerRecord) -> bool | None:
    match record:
        case MigrationRecord():
            return record.outcome == "committed"
        case DecisionRecord():
            return record.committed
        case SafeModeRecord() | ObservationRecord() | GraphFindingRecord():
            return None
