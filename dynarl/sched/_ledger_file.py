"""Reading a ledger file: each line's records, what the file held, and what it is not.

:func:`read_ledger` decodes a JSONL ledger line by line (a line whose reasons are
sentences is upgraded first, see :mod:`dynarl.sched._ledger_legacy`), expands each run of
rounds, and hands every record to the caller. It forgives the one mark a crash leaves
and nothing else:

- a *final* line with no newline that is not JSON is a record the writer was cut off in
  (the job stopped mid-write): it is skipped, and :attr:`LedgerFile.skipped_bytes` says
  how many bytes it had;
- any other line that is not a ledger record is damage: ValueError naming its line;
- a file whose first line is no ledger record at all (a JSON document, JSON lines of
  something else, text) is not a ledger: ValueError saying what it is instead.

:class:`LedgerFile` is what was read: the lines of each record kind, the rounds inside
runs, the lines that write a record again, the bytes skipped. Pure but for reading the
file; runs anywhere.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgspec

from dynarl.bus import DecisionRecord, MigrationRecord
from dynarl.sched._ledger_legacy import upgrade_line
from dynarl.sched._ledger_records import (
    GraphFindingRecord,
    LedgerRecord,
    ObservationRecord,
    RoundsRecord,
    SafeModeRecord,
)

__all__ = ["LINE_KINDS", "LedgerFile", "open_for_append", "read_ledger"]

# Lax decoding reads the strings "inf", "-inf" and "nan" back into float fields.
_DECODER = msgspec.json.Decoder(LedgerRecord | RoundsRecord, strict=False)
_KINDS: dict[type, str] = {
    DecisionRecord: "decision",
    RoundsRecord: "rounds",
    MigrationRecord: "migration",
    SafeModeRecord: "safety",
    ObservationRecord: "observation",
    GraphFindingRecord: "graph",
}
LINE_KINDS = tuple(_KINDS.values())
"""The kinds of line :attr:`LedgerFile.lines_by_kind` counts, in the order a summary names
them."""
_TAGS = frozenset(t.__name__ for t in _KINDS)
"""The ``type`` of every ledger line (the records' msgspec tags)."""
_MAX_DOCUMENT = 64 << 20
"""Largest file read whole to tell a JSON document from a ledger (bytes)."""
_TAIL_CHUNK = 1 << 16

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerFile:
    """What :func:`read_ledger` (and :meth:`~dynarl.sched.Ledger.load`) found in a file."""

    num_lines: int
    """Lines holding a record (blank lines and a skipped torn line not counted)."""
    lines_by_kind: Mapping[str, int]
    """Lines that write a record for the first time, by kind (:data:`LINE_KINDS`):
    ``decision`` (one decision round), ``rounds`` (a run of consecutive rounds without a
    move on one line), ``migration``, ``safety`` (a safe-mode transition), ``observation``,
    ``graph`` (a start-up graph finding)."""
    num_run_rounds: int
    """Decision rounds inside the ``rounds`` lines."""
    num_updates: int
    """Lines that write an earlier line's record again, its realised effect filled in (the
    last one is the record)."""
    skipped_bytes: int = 0
    """Bytes of a torn final line left out: no newline and not JSON, so a record the
    writer was cut off in (0: the file ends with a whole line)."""


def read_ledger(
    path: str | os.PathLike[str], remember: Callable[[LedgerRecord], bool]
) -> LedgerFile:
    """Read ``path``, calling ``remember(record)`` for every record in file order (runs
    expanded); ``remember`` says whether the record is new (False: it replaces one).

    Raises OSError when the file cannot be read, ValueError naming the line of a record
    that is damaged, or saying what the file is when it is not a ledger.
    """
    kinds: Counter[str] = Counter()
    num_lines = run_rounds = updates = skipped = 0
    with Path(path).open("rb") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = _decode(line)
                records = record.rounds() if isinstance(record, RoundsRecord) else [record]
            except (msgspec.DecodeError, ValueError) as err:
                if _torn(line):
                    skipped = len(line)  # without a newline it is the last line
                    break
                raise ValueError(_refusal(path, number, line, err, first=num_lines == 0)) from None
            num_lines += 1
            new = [remember(one) for one in records]
            if isinstance(record, RoundsRecord):
                kinds["rounds"] += 1
                run_rounds += len(records)
            elif new[0]:
                kinds[_KINDS[type(record)]] += 1
            else:
                updates += 1
    return LedgerFile(
        num_lines=num_lines,
        lines_by_kind={k: kinds[k] for k in LINE_KINDS if kinds[k]},
        num_run_rounds=run_rounds,
        num_updates=updates,
        skipped_bytes=skipped,
    )


def _decode(line: bytes) -> LedgerRecord | RoundsRecord:
    """One ledger line's record; a line whose reasons are sentences is upgraded first.

    Raises msgspec.DecodeError (a ValueError) for a line that is neither.
    """
    record: LedgerRecord | RoundsRecord
    try:
        record = _DECODER.decode(line)
    except msgspec.ValidationError:
        upgraded = upgrade_line(msgspec.json.decode(line))
        record = msgspec.convert(upgraded, LedgerRecord | RoundsRecord, strict=False)
    return record


def _json(data: bytes) -> tuple[bool, Any]:
    """Whether ``data`` is one JSON value, and the value."""
    try:
        return True, msgspec.json.decode(data)
    except msgspec.DecodeError:
        return False, None


def _torn(line: bytes) -> bool:
    """Whether ``line`` is a record the writer was cut off in: the last line (no newline),
    begun as a record is (``{``), and not JSON."""
    return not line.endswith(b"\n") and line.lstrip().startswith(b"{") and not _json(line)[0]


def _refusal(
    path: str | os.PathLike[str], number: int, line: bytes, err: Exception, *, first: bool
) -> str:
    """Why the file cannot be read: not a ledger (``first``: nothing read before ``line``),
    or a damaged record at line ``number``."""
    if first:
        what = _not_a_ledger(path, line)
        if what is not None:
            return f"{path} is not a dynarl ledger: {what}"
    return f"{path}:{number}: bad ledger record: {err}"


def _not_a_ledger(path: str | os.PathLike[str], line: bytes) -> str | None:
    """What the file is, judged by its first line that is no record (None: that line has
    a ledger record's type, so the file is a damaged ledger)."""
    is_json, value = _json(line)
    if is_json:
        if isinstance(value, dict) and value.get("type") in _TAGS:
            return None
        return f"its first line is {_describe(value)}, not a ledger record"
    if os.path.getsize(path) <= _MAX_DOCUMENT:
        is_json, value = _json(Path(path).read_bytes())
        if is_json:
            return f"it is one JSON document ({_describe(value)}), not one record per line"
    text = line.decode("utf-8", "replace").strip()
    excerpt = text if len(text) <= 40 else text[:37] + "..."
    return f"its first line is not JSON ({excerpt!r}); a ledger has one JSON record per line"


def _describe(value: Any) -> str:
    """A JSON value in a few words: ``a JSON object with keys 'a', 'b'``."""
    match value:
        case {"type": str(tag)}:
            return f"a JSON object of type {tag!r}"
        case dict() if not value:
            return "an empty JSON object"
        case dict():
            keys = ", ".join(repr(k) for k in list(value)[:4])
            return f"a JSON object with keys {keys}" + (", ..." if len(value) > 4 else "")
        case list():
            return f"a JSON list of {len(value)} items"
        case bool() | None:
            return f"JSON {msgspec.json.encode(value).decode()}"
        case str():
            return "a JSON string"
        case _:
            return "a JSON number"


def open_for_append(path: Path) -> IO[bytes]:
    """Open a ledger to append to, first cutting a torn final line off it.

    A job restarted on the run directory of one that stopped mid-write would otherwise
    append after the torn line, which would then sit mid-file and read as damage. Only
    bytes after the last newline that are not JSON are cut (a record the writer never
    finished; a whole record missing its newline gets one); the cut is logged with its size.
    """
    sink = path.open("ab")
    size = sink.tell()
    if size == 0:
        return sink
    with path.open("rb") as source:
        end = size
        while end > 0:
            start = max(0, end - _TAIL_CHUNK)
            source.seek(start)
            chunk = source.read(end - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
    if end < size:
        with path.open("rb") as source:
            source.seek(end)
            tail = source.read()
        if _json(tail)[0]:  # a whole record whose newline was not written: keep it
            sink.write(b"\n")
            return sink
        sink.truncate(end)
        sink.seek(end)
        logger.warning(
            "%s ended in a torn line (the job stopped while writing it): cut its %d bytes "
            "off before appending",
            path,
            size - end,
        )
    return sink
