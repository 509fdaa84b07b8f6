"""The journal's records and the pure fold that turns them into the controller's state.

Records are tagged ``msgspec`` structs (MessagePack in the journal file). The commit point
of a migration is the :class:`AllocationCommitted` record that names it: one record, so a
crash leaves a migration either committed or in flight, never half of each.
:func:`apply` is pure and raises ValueError for a record that breaks the protocol; the
journal applies each record before writing it, and recovery folds the file with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import msgspec

from dynarl.migrate import KIND_STEPS
from dynarl.types import Allocation, MigrationKind

__all__ = [
    "AllocationCommitted",
    "CheckpointSaved",
    "JournalHeader",
    "JournalRecord",
    "JournalState",
    "MigrationBegun",
    "MigrationEnded",
    "MigrationStepped",
    "Restored",
    "StepCompleted",
    "apply",
]


class JournalHeader(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The first record of every journal."""

    format: int
    """Journal format version."""
    job: str
    """Name of the job that wrote it (informational)."""
    time: float
    """Wall-clock time it was created, seconds since the epoch."""


class AllocationCommitted(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A new allocation is in force (the commit point of a migration, when it names one)."""

    epoch: int
    """Its epoch: the previous one plus one (the first is 1)."""
    allocation: dict[str, list[int]]
    """``{component: devices}``."""
    migration_id: str = ""
    """The in-flight migration this commits, or empty (initial or operator allocation)."""
    time: float
    """Wall-clock time, seconds."""


class MigrationBegun(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A migration started; until it ends, the journal's epoch is its ``from_epoch``."""

    migration_id: str
    """Unique id."""
    kind: str
    """A :class:`~dynarl.types.MigrationKind` value."""
    component: str
    """Component whose state moves."""
    devices: tuple[int, ...]
    """Devices that change hands."""
    from_epoch: int
    """Epoch of the allocation it starts from (the rollback target)."""
    target: dict[str, list[int]]
    """Allocation it commits (roll-forward target)."""
    deadline: float
    """Lease deadline on the job clock, seconds."""
    time: float
    """Wall-clock time, seconds."""


class MigrationStepped(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One phase of the in-flight migration finished (``prepare``, ``transfer``...)."""

    migration_id: str
    """The in-flight migration."""
    step: str
    """A :class:`~dynarl.migrate.Step` value."""
    ok: bool
    """Whether it succeeded."""
    detail: str = ""
    """Why it failed."""
    time: float
    """Wall-clock time, seconds."""


class MigrationEnded(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The in-flight migration ended without committing; its ``from_epoch`` stays."""

    migration_id: str
    """The in-flight migration."""
    outcome: Literal["rolled_back", "failed"]
    """``rolled_back`` (previous allocation restored) or ``failed`` (needs a checkpoint)."""
    reason: str = ""
    """Why."""
    time: float
    """Wall-clock time, seconds."""


class CheckpointSaved(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A checkpoint was published (its manifest is durable)."""

    steps_done: int
    """Training steps completed when it was taken."""
    path: str
    """Its directory."""
    version: int
    """Model version it holds."""
    cursor: int
    """Sample cursor to resume from."""
    digest: str
    """SHA-256 of its manifest (what a restore checks)."""
    time: float
    """Wall-clock time, seconds."""


class StepCompleted(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Training step ``step`` finished."""

    step: int
    """Step index, from 0."""
    cursor: int
    """Sample cursor after the step."""
    digest: str = ""
    """Digest of the step's sample manifest (ids and update order)."""
    time: float
    """Wall-clock time, seconds."""


class Restored(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The job restored a checkpoint; steps from ``steps_done`` on will be redone."""

    steps_done: int
    """Steps the checkpoint holds."""
    cursor: int
    """Sample cursor it rewound to."""
    path: str
    """The checkpoint's directory."""
    time: float
    """Wall-clock time, seconds."""


JournalRecord = (
    JournalHeader
    | AllocationCommitted
    | MigrationBegun
    | MigrationStepped
    | MigrationEnded
    | CheckpointSaved
    | StepCompleted
    | Restored
)
"""Every record a journal holds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JournalState:
    """What a restarted controller needs, as of the last record."""

    started: bool = False
    """Whether the header was read."""
    epoch: int = 0
    """Epoch of the committed allocation (0: none yet)."""
    allocation: Allocation | None = None
    """The committed allocation."""
    in_flight: MigrationBegun | None = None
    """The migration begun but neither committed nor ended, if any."""
    in_flight_steps: tuple[MigrationStepped, ...] = ()
    """Its recorded phases, in order."""
    checkpoint: CheckpointSaved | None = None
    """The last published checkpoint."""
    steps_done: int = 0
    """Training steps completed (the next step's index)."""
    cursor: int = 0
    """Sample cursor after the last completed step (or restore)."""
    digests: tuple[tuple[int, str], ...] = ()
    """``(step, digest)`` of the steps completed since the last checkpoint: what redone
    steps must reproduce."""
    num_records: int = 0
    """Records folded so far."""
    migrations_begun: int = 0
    """Migrations ever begun: a restarted controller numbers its decisions past them, so
    that a migration id is never journalled twice."""

    @property
    def resolution(self) -> Literal["none", "roll_forward", "roll_back"]:
        """What the journal allows for the in-flight migration: ``roll_forward`` when
        every phase before commit succeeded (the controller may commit ``target`` once its
        participants confirm they hold it), ``roll_back`` otherwise, ``none`` if idle."""
        if self.in_flight is None:
            return "none"
        forward = KIND_STEPS[MigrationKind(self.in_flight.kind)][:-1]
        succeeded = {s.step for s in self.in_flight_steps if s.ok}
        failed = any(not s.ok for s in self.in_flight_steps)
        if not failed and all(str(step) in succeeded for step in forward):
            return "roll_forward"
        return "roll_back"

    def expected_digest(self, step: int) -> str | None:
        """The digest recorded when ``step`` first completed, if still kept."""
        for index, digest in self.digests:
            if index == step:
                return digest
        return None


def apply(state: JournalState, record: JournalRecord) -> JournalState:
    """The state after ``record`` (pure). Raises ValueError if it breaks the protocol."""
    if not state.started and not isinstance(record, JournalHeader):
        raise ValueError("a journal must start with its header")
    match record:
        case JournalHeader():
            if state.started:
                raise ValueError("a second journal header")
            new = replace(state, started=True)
        case AllocationCommitted():
            new = _commit(state, record)
        case MigrationBegun():
            new = _begin(state, record)
        case MigrationStepped():
            _check_in_flight(state, record.migration_id)
            new = replace(state, in_flight_steps=(*state.in_flight_steps, record))
        case MigrationEnded():
            _check_in_flight(state, record.migration_id)
            new = replace(state, in_flight=None, in_flight_steps=())
        case CheckpointSaved():
            new = _checkpoint(state, record)
        case StepCompleted():
            new = _step(state, record)
        case Restored():
            new = _restore(state, record)
    return replace(new, num_records=state.num_records + 1)


def _commit(state: JournalState, record: AllocationCommitted) -> JournalState:
    if record.epoch != state.epoch + 1:
        raise ValueError(f"epoch {record.epoch} does not follow epoch {state.epoch}")
    allocation = Allocation.of(record.allocation)
    if record.migration_id:
        _check_in_flight(state, record.migration_id)
        assert state.in_flight is not None
        if allocation != Allocation.of(state.in_flight.target):
            raise ValueError(f"commit of {record.migration_id!r} is not its target allocation")
    elif state.in_flight is not None:
        raise ValueError(f"migration {state.in_flight.migration_id!r} is in flight")
    return replace(
        state, epoch=record.epoch, allocation=allocation, in_flight=None, in_flight_steps=()
    )


def _begin(state: JournalState, record: MigrationBegun) -> JournalState:
    if state.in_flight is not None:
        raise ValueError(f"migration {state.in_flight.migration_id!r} is already in flight")
    if state.allocation is None or record.from_epoch != state.epoch:
        raise ValueError(f"a migration from epoch {record.from_epoch} at epoch {state.epoch}")
    if not record.migration_id:
        raise ValueError("migration_id must not be empty")
    MigrationKind(record.kind)
    Allocation.of(record.target)
    return replace(
        state, in_flight=record, in_flight_steps=(), migrations_begun=state.migrations_begun + 1
    )


def _check_in_flight(state: JournalState, migration_id: str) -> None:
    if state.in_flight is None or state.in_flight.migration_id != migration_id:
        raise ValueError(f"migration {migration_id!r} is not in flight")


def _checkpoint(state: JournalState, record: CheckpointSaved) -> JournalState:
    if not 0 <= record.steps_done <= state.steps_done:
        raise ValueError(f"checkpoint at {record.steps_done} steps, {state.steps_done} done")
    kept = tuple((s, d) for s, d in state.digests if s >= record.steps_done)
    return replace(state, checkpoint=record, digests=kept)


def _step(state: JournalState, record: StepCompleted) -> JournalState:
    if record.step != state.steps_done:
        raise ValueError(f"step {record.step} completed when step {state.steps_done} was next")
    if record.cursor < state.cursor:
        raise ValueError(f"sample cursor went back from {state.cursor} to {record.cursor}")
    kept = state.digests  # a redone step keeps its first digest: the one to reproduce
    if state.expected_digest(record.step) is None:
        kept = (*kept, (record.step, record.digest))
    return replace(state, steps_done=record.step + 1, cursor=record.cursor, digests=kept)


def _restore(state: JournalState, record: Restored) -> JournalState:
    if record.steps_done > state.steps_done:
        raise ValueError(f"restore to {record.steps_done} steps ahead of {state.steps_done}")
    return replace(state, steps_done=record.steps_done, cursor=record.cursor)
