"""The ledger: every decision round and every migration outcome, queryable and on disk.

Records are the bus's :class:`~dynarl.bus.DecisionRecord` and
:class:`~dynarl.bus.MigrationRecord`. Each append goes to memory and, when the ledger has
a path, as one JSON line to an append-only file that is flushed at once. Realised effects
(iteration-time change, prediction error) are filled in later by appending the updated
record again; readers keep the last line per id. Runs on the controller, in the
scheduler's loop; appends are small and flushed, not fsynced (the allocation journal is
the runtime's durable record).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Literal

import msgspec

from dynarl.bus.records import DecisionRecord, MigrationRecord

__all__ = ["Ledger", "LedgerRecord"]

logger = logging.getLogger(__name__)

LedgerRecord = DecisionRecord | MigrationRecord
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(LedgerRecord)


def _record_id(record: LedgerRecord) -> str:
    return record.decision_id if isinstance(record, DecisionRecord) else record.migration_id


class Ledger:
    """Decision and migration records: an in-memory index plus an optional JSONL sink.

    Use as a (sync or async) context manager, or call :meth:`close`. Raises ValueError
    for a record id that is unknown when filling in realised effects.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._records: dict[tuple[str, str], LedgerRecord] = {}
        self._file: IO[bytes] | None = None
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self._file = self.path.open("ab")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Ledger:
        """Read a JSONL ledger back (the last line per id wins); memory only.

        Raises ValueError naming the line of a malformed record.
        """
        ledger = cls()
        with Path(path).open("rb") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    record = _DECODER.decode(line)
                except msgspec.DecodeError as err:
                    raise ValueError(f"{path}:{number}: bad ledger record: {err}") from None
                ledger._remember(record)
        return ledger

    def _remember(self, record: LedgerRecord) -> None:
        kind = "decision" if isinstance(record, DecisionRecord) else "migration"
        self._records[(kind, _record_id(record))] = record

    def append(self, record: LedgerRecord) -> None:
        """Record ``record`` (replacing an earlier one with the same id) and write it out."""
        self._remember(record)
        if self._file is not None:
            self._file.write(_ENCODER.encode(record) + b"\n")
            self._file.flush()

    def fill_realised(
        self,
        record_id: str,
        *,
        realised_iteration_delta_s: float | None = None,
        prediction_error: float | None = None,
        kind: Literal["decision", "migration"] = "decision",
    ) -> LedgerRecord:
        """Fill in the measured effect of a decision (or migration) and write it out again."""
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

    def get(
        self, record_id: str, kind: Literal["decision", "migration"] = "decision"
    ) -> LedgerRecord:
        """The record with ``record_id``; raises ValueError if there is none."""
        try:
            return self._records[(kind, record_id)]
        except KeyError:
            raise ValueError(f"no {kind} record {record_id!r} in the ledger") from None

    def query(
        self,
        *,
        kind: Literal["decision", "migration"] | None = None,
        component: str | None = None,
        since: float | None = None,
        until: float | None = None,
        committed: bool | None = None,
        reason: str | None = None,
    ) -> list[LedgerRecord]:
        """Records matching every given filter, by time.

        ``component`` matches a decision's donor, receivers or predicted bottleneck and a
        migration's component; ``committed`` matches a decision's flag and a migration's
        ``outcome == "committed"``; ``reason`` is a substring of the record's reason.
        """
        out = [
            r
            for (k, _), r in self._records.items()
            if (kind is None or k == kind)
            and (since is None or r.time >= since)
            and (until is None or r.time <= until)
            and (component is None or component in _components(r))
            and (committed is None or _committed(r) == committed)
            and (reason is None or reason in r.reason)
        ]
        return sorted(out, key=lambda r: (r.time, _record_id(r)))

    def __iter__(self) -> Iterator[LedgerRecord]:
        return iter(self.query())

    def __len__(self) -> int:
        return len(self._records)

    def close(self) -> None:
        """Close the sink (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

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
    if isinstance(record, MigrationRecord):
        return {record.component}
    names = {record.donor, record.predicted_bottleneck, *record.receivers}
    return {n for n in names if n is not None}


def _committed(record: LedgerRecord) -> bool:
    if isinstance(record, MigrationRecord):
        return record.outcome == "committed"
    return record.committed
