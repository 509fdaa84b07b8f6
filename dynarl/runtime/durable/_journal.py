"""The allocation journal: an append-only, fsynced log from which a restarted controller
recovers the committed allocation, an in-flight migration, the last checkpoint and the
sample cursor.

**Format.** A file of frames, one record each::

    magic   4 bytes   b"DRJ1"
    length  u32 LE    payload size in bytes
    crc     u32 LE    CRC-32 of the length field and the payload
    payload           MessagePack of one tagged record (msgspec), see :data:`JournalRecord`

Why framed MessagePack rather than JSON lines: a length prefix and a CRC decide exactly
whether the last frame is whole, wherever a crash cut it (a torn JSON line can still parse,
and a flipped bit inside a complete line cannot be seen); the records are the same
``msgspec`` structs the bus uses; and the magic lets a reader tell a torn tail (nothing
valid follows the damage: ignored, and cut off when the journal is reopened for writing)
from damage before the end (valid frames follow it: :class:`~dynarl.errors.IntegrityError`).
``read_journal`` decodes a file for inspection.

**Protocol.** :func:`apply` folds one record into a :class:`JournalState` and raises
ValueError for a record that breaks the protocol (an epoch that does not follow, a second
migration while one is in flight, a step out of order). The writer applies every record
before writing it, so the file only ever holds valid sequences; recovery is the same fold.

The journal is written by the controller only (rank 0 under torchrun), from its event loop
or a worker thread: each append is one ``write`` and one ``fsync`` (about a millisecond
on a local SSD), serialised by a lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

import msgspec

from dynarl.errors import IntegrityError
from dynarl.runtime.durable._journal_records import (
    AllocationCommitted,
    CheckpointSaved,
    JournalHeader,
    JournalRecord,
    JournalState,
    MigrationBegun,
    MigrationEnded,
    MigrationStepped,
    Restored,
    StepCompleted,
    apply,
)
from dynarl.types import Allocation, MigrationKind

__all__ = ["FORMAT_VERSION", "Journal", "JournalRead", "read_journal", "recover"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version written in the header record; readers refuse other versions."""
MAGIC = b"DRJ1"
_HEADER = struct.Struct("<4sII")
_MAX_RECORD_BYTES = 16 * 1024 * 1024
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(JournalRecord)


def frame(record: JournalRecord) -> bytes:
    """The bytes of one record as written to the journal."""
    payload = _ENCODER.encode(record)
    length = struct.pack("<I", len(payload))
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(length + payload)) + payload


def _frame_at(data: bytes, offset: int) -> tuple[bytes, int] | None:
    """(payload, end offset) of a whole, checksummed frame at ``offset``, else None."""
    end = offset + _HEADER.size
    if end > len(data):
        return None
    magic, length, crc = _HEADER.unpack_from(data, offset)
    if magic != MAGIC or length > _MAX_RECORD_BYTES or end + length > len(data):
        return None
    payload = data[end : end + length]
    if zlib.crc32(data[offset + 4 : offset + 8] + payload) != crc:
        return None
    return payload, end + length


def _intact_frame_after(data: bytes, offset: int) -> int | None:
    """Offset of the first whole frame starting after ``offset``, if any."""
    position = data.find(MAGIC, offset + 1)
    while position != -1:
        if _frame_at(data, position) is not None:
            return position
        position = data.find(MAGIC, position + 1)
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class JournalRead:
    """What a journal file holds."""

    records: tuple[JournalRecord, ...]
    """Every whole record, in order."""
    valid_bytes: int
    """Length of the prefix made of whole records."""
    torn_bytes: int
    """Bytes after it: a record cut by a crash (ignored)."""


def read_journal(path: str | os.PathLike[str]) -> JournalRead:
    """Decode every whole record of the journal at ``path``.

    A damaged tail with no whole frame after it is a torn last record: it is reported in
    ``torn_bytes`` and ignored. Raises IntegrityError when whole frames follow damaged
    bytes (the file was damaged before its end), when a checksummed frame does not decode,
    or when the header is missing or of another format version; OSError if unreadable.
    """
    data = Path(path).read_bytes()
    records: list[JournalRecord] = []
    offset = 0
    while offset < len(data):
        found = _frame_at(data, offset)
        if found is None:
            later = _intact_frame_after(data, offset)
            if later is not None:
                raise IntegrityError(
                    f"{path}: bytes {offset}..{later} are damaged but records follow them"
                )
            break
        payload, end = found
        try:
            records.append(_DECODER.decode(payload))
        except msgspec.DecodeError as err:
            message = f"{path}: record at byte {offset} does not decode: {err}"
            raise IntegrityError(message) from None
        offset = end
    _check_header(path, records)
    return JournalRead(records=tuple(records), valid_bytes=offset, torn_bytes=len(data) - offset)


def _check_header(path: str | os.PathLike[str], records: Sequence[JournalRecord]) -> None:
    if not records:
        return
    first = records[0]
    if not isinstance(first, JournalHeader):
        raise IntegrityError(f"{path}: the first record is not a journal header")
    if first.format != FORMAT_VERSION:
        raise IntegrityError(f"{path}: journal format {first.format}, expected {FORMAT_VERSION}")


def _fold(path: str | os.PathLike[str], records: Sequence[JournalRecord]) -> JournalState:
    state = JournalState()
    for index, record in enumerate(records):
        try:
            state = apply(state, record)
        except ValueError as err:
            raise IntegrityError(f"{path}: record {index} breaks the protocol: {err}") from None
    return state


def recover(path: str | os.PathLike[str]) -> JournalState:
    """The state after the last whole record of the journal at ``path``.

    A missing or empty file recovers the empty state. Raises IntegrityError as
    :func:`read_journal` does, or when the records break the protocol.
    """
    if not Path(path).exists():
        return JournalState()
    read = read_journal(path)
    if read.torn_bytes:
        logger.warning("journal %s: ignored a torn last record (%d bytes)", path, read.torn_bytes)
    return _fold(path, read.records)


class Journal:
    """The writer: recovers ``path`` (creating it if needed), cuts a torn tail, appends.

    Constructing opens the file, as :func:`open` does (a failure part-way closes it again);
    use as a context manager or call :meth:`close`. Every append validates the record
    (ValueError, nothing written), writes it whole and fsyncs it before returning; if the
    write fails, the file is cut back to its last whole record and the error re-raised.
    Raises IntegrityError when opening a damaged journal.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        job: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        existing = self.path.exists() and self.path.stat().st_size > 0
        read = read_journal(self.path) if existing else None
        self._state = _fold(self.path, read.records) if read else JournalState()
        self._size = read.valid_bytes if read else 0
        if read is not None and read.torn_bytes:
            logger.warning("journal %s: cut a torn last record (%d bytes)", path, read.torn_bytes)
        with contextlib.ExitStack() as opening:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            opening.callback(self.close)  # unless the journal opens whole
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
            if not existing or not self._state.started:
                _fsync_directory(self.path.parent)
                self.append(JournalHeader(format=FORMAT_VERSION, job=job, time=self._clock()))
            opening.pop_all()
        logger.info("journal %s open at epoch %d", self.path, self._state.epoch)

    @property
    def state(self) -> JournalState:
        """The state after the last record written."""
        return self._state

    def append(self, record: JournalRecord) -> JournalState:
        """Validate, write and fsync ``record``; returns the new state.

        Raises ValueError if the record breaks the protocol (nothing is written), OSError
        if the write fails (the file keeps its previous records), IntegrityError if an
        earlier failed write could not be undone.
        """
        with self._lock:
            if self._fd < 0:
                raise ValueError(f"journal {self.path} is closed")
            state = apply(self._state, record)
            data = frame(record)
            try:
                _write_all(self._fd, self._size, data)
                os.fsync(self._fd)
            except OSError:
                self._undo()
                raise
            self._size += len(data)
            self._state = state
            return state

    def _undo(self) -> None:
        try:
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        except OSError as err:
            os.close(self._fd)
            self._fd = -1
            raise IntegrityError(f"journal {self.path}: could not undo a failed write") from err

    # ------------------------------------------------------------------ shorthands

    def commit(self, allocation: Allocation, *, migration_id: str = "") -> int:
        """Commit ``allocation`` as the next epoch (ending migration ``migration_id``, whose
        target it must be, if given); returns the epoch."""
        epoch = self._state.epoch + 1
        self.append(
            AllocationCommitted(
                epoch=epoch,
                allocation=allocation.as_dict(),
                migration_id=migration_id,
                time=self._clock(),
            )
        )
        return epoch

    def begin_migration(
        self,
        *,
        migration_id: str,
        kind: MigrationKind,
        component: str,
        devices: Sequence[int],
        target: Allocation,
        deadline: float,
    ) -> None:
        """Record that migration ``migration_id`` starts from the current epoch towards
        ``target``, moving ``devices`` of ``component``, with its lease ``deadline``."""
        self.append(
            MigrationBegun(
                migration_id=migration_id,
                kind=str(kind),
                component=component,
                devices=tuple(devices),
                from_epoch=self._state.epoch,
                target=target.as_dict(),
                deadline=deadline,
                time=self._clock(),
            )
        )

    def record_step(self, migration_id: str, step: str, *, ok: bool, detail: str = "") -> None:
        """Record the outcome of one phase (``prepare``, ``transfer``...) of the migration."""
        self.append(
            MigrationStepped(
                migration_id=migration_id, step=step, ok=ok, detail=detail, time=self._clock()
            )
        )

    def end_migration(
        self, migration_id: str, outcome: Literal["rolled_back", "failed"], reason: str = ""
    ) -> None:
        """Record that the migration ended without committing (the epoch stays)."""
        self.append(
            MigrationEnded(
                migration_id=migration_id, outcome=outcome, reason=reason, time=self._clock()
            )
        )

    def record_checkpoint(
        self, *, steps_done: int, path: str, version: int, cursor: int, digest: str
    ) -> None:
        """Record a published checkpoint (after its manifest is durable)."""
        self.append(
            CheckpointSaved(
                steps_done=steps_done,
                path=path,
                version=version,
                cursor=cursor,
                digest=digest,
                time=self._clock(),
            )
        )

    def complete_step(self, step: int, *, cursor: int, digest: str = "") -> None:
        """Record that training step ``step`` finished; ``cursor`` is the sample cursor
        after it and ``digest`` its sample manifest digest."""
        self.append(StepCompleted(step=step, cursor=cursor, digest=digest, time=self._clock()))

    def restored(self, *, steps_done: int, cursor: int, path: str) -> None:
        """Record that the job restored the checkpoint at ``path`` (steps after
        ``steps_done`` will be redone from ``cursor``)."""
        self.append(Restored(steps_done=steps_done, cursor=cursor, path=path, time=self._clock()))

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _write_all(fd: int, offset: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _fsync_directory(directory: Path) -> None:
    """Make a new entry in ``directory`` durable (a crash could otherwise lose the file)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
