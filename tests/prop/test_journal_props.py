"""The allocation journal: torn tails at any byte, damage before the end, and a model-based
machine of append / crash / reopen against an independent model of the controller state."""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from dynarl.errors import IntegrityError
from dynarl.migrate._protocol import KIND_STEPS
from dynarl.runtime.durable._journal import FORMAT_VERSION, Journal, frame, read_journal, recover
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

COMPONENTS = ("inference", "rollout", "trainer")
TEXT = st.text(max_size=12) | st.just("DRJ1")


@st.composite
def allocations(draw: st.DrawFn) -> Allocation:
    owners = draw(st.lists(st.sampled_from((*COMPONENTS, None)), min_size=1, max_size=6))
    mapping: dict[str, list[int]] = {}
    for device, owner in enumerate(owners):
        if owner is not None:
            mapping.setdefault(owner, []).append(device)
    return Allocation.of(mapping)


def _next(draw: st.DrawFn, state: JournalState) -> JournalRecord:
    """One record that is valid after ``state``."""
    options = ["checkpoint", "step"]
    if state.in_flight is None:
        options.append("commit")
        if state.allocation is not None:
            options.append("begin")
    else:
        options += ["stepped", "stepped", "end", "commit_migration"]
    if state.steps_done:
        options.append("restore")
    match draw(st.sampled_from(options)):
        case "commit":
            alloc = draw(allocations()).as_dict()
            return AllocationCommitted(epoch=state.epoch + 1, allocation=alloc, time=1.0)
        case "begin":
            return MigrationBegun(
                migration_id=draw(TEXT.filter(bool)),
                kind=str(draw(st.sampled_from(MigrationKind))),
                component=draw(st.sampled_from(COMPONENTS)),
                devices=tuple(draw(st.lists(st.integers(0, 5), max_size=3))),
                from_epoch=state.epoch,
                target=draw(allocations()).as_dict(),
                deadline=draw(st.floats(0, 1e6)),
                time=2.0,
            )
        case "stepped":
            assert state.in_flight is not None
            steps = [str(s) for s in KIND_STEPS[MigrationKind(state.in_flight.kind)]]
            return MigrationStepped(
                migration_id=state.in_flight.migration_id,
                step=draw(st.sampled_from(steps)),
                ok=draw(st.booleans()),
                detail=draw(TEXT),
                time=3.0,
            )
        case "end":
            assert state.in_flight is not None
            return MigrationEnded(
                migration_id=state.in_flight.migration_id,
                outcome=draw(st.sampled_from(("rolled_back", "failed"))),
                reason=draw(TEXT),
                time=4.0,
            )
        case "commit_migration":
            assert state.in_flight is not None
            return AllocationCommitted(
                epoch=state.epoch + 1,
                allocation=state.in_flight.target,
                migration_id=state.in_flight.migration_id,
                time=5.0,
            )
        case "checkpoint":
            return CheckpointSaved(
                steps_done=draw(st.integers(0, state.steps_done)),
                path=draw(TEXT),
                version=draw(st.integers(0, 2**40)),
                cursor=draw(st.integers(0, 2**40)),
                digest=draw(TEXT),
                time=6.0,
            )
        case "step":
            return StepCompleted(
                step=state.steps_done,
                cursor=state.cursor + draw(st.integers(0, 64)),
                digest=draw(TEXT),
                time=7.0,
            )
        case _:
            return Restored(
                steps_done=draw(st.integers(0, state.steps_done)),
                cursor=draw(st.integers(0, state.cursor)),
                path=draw(TEXT),
                time=8.0,
            )


@st.composite
def record_sequences(draw: st.DrawFn) -> list[JournalRecord]:
    """A valid sequence of records (after the header the journal writes itself)."""
    state = apply(JournalState(), _header())
    records: list[JournalRecord] = []
    for _ in range(draw(st.integers(0, 25))):
        record = _next(draw, state)
        state = apply(state, record)
        records.append(record)
    return records


def _header() -> JournalRecord:
    return JournalHeader(format=FORMAT_VERSION, job="prop", time=0.0)


def _write(path: Path, records: list[JournalRecord]) -> list[int]:
    """Write the frames the journal writes (header first); the file size after each."""
    ends, data = [], b""
    for record in [_header(), *records]:
        data += frame(record)
        ends.append(len(data))
    path.write_bytes(data)
    return ends


def _fold(records: list[JournalRecord]) -> JournalState:
    state = JournalState()
    for record in [_header(), *records]:
        state = apply(state, record)
    return state


@given(records=record_sequences(), data=st.data())
def test_a_cut_at_any_byte_recovers_the_last_whole_record(
    records: list[JournalRecord], data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal"
        ends = _write(path, records)
        full = path.read_bytes()
        cut = data.draw(st.integers(0, len(full)), label="cut")
        path.write_bytes(full[:cut])
        whole = sum(1 for end in ends if end <= cut)  # header included
        expected = _fold(records[: whole - 1]) if whole else JournalState()
        assert recover(path) == expected
        assert read_journal(path).torn_bytes == cut - (ends[whole - 1] if whole else 0)
        # Reopening cuts the torn tail: a record appended now is read back after the others.
        with Journal(path, clock=lambda: 0.0) as journal:
            journal.record_checkpoint(steps_done=0, path="after", version=1, cursor=0, digest="")
        recovered = recover(path)
        assert recovered.checkpoint is not None and recovered.checkpoint.path == "after"
        assert recovered.epoch == expected.epoch and recovered.steps_done == expected.steps_done


@given(records=record_sequences(), data=st.data())
def test_damage_before_the_last_record_is_an_integrity_error(
    records: list[JournalRecord], data: st.DataObject
) -> None:
    assume(records)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal"
        ends = _write(path, records)
        full = bytearray(path.read_bytes())
        position = data.draw(st.integers(0, len(full) - 1), label="position")
        full[position] ^= data.draw(st.integers(1, 255), label="flip")
        path.write_bytes(bytes(full))
        if position < ends[-2]:
            with pytest.raises(IntegrityError, match="damaged but records follow"):
                recover(path)
        else:  # the last record: indistinguishable from a torn write, so ignored
            assert recover(path) == _fold(records[:-1])


def test_a_record_that_breaks_the_protocol_is_refused_and_not_written(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    with Journal(path) as journal:
        journal.commit(Allocation.of({"rollout": [0, 1]}))
        size = path.stat().st_size
        bad = [
            AllocationCommitted(epoch=3, allocation={"rollout": [0]}, time=0.0),
            MigrationEnded(migration_id="nope", outcome="failed", time=0.0),
            StepCompleted(step=1, cursor=0, time=0.0),
        ]
        for record in bad:
            with pytest.raises(ValueError):
                journal.append(record)
        assert path.stat().st_size == size and journal.state.epoch == 1
    assert recover(path).epoch == 1


def test_a_valid_frame_of_an_unknown_record_is_an_integrity_error(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    with Journal(path) as journal:
        journal.commit(Allocation.of({"rollout": [0]}))
    good = frame(StepCompleted(step=0, cursor=1, time=0.0))
    forged = good.replace(b"StepCompleted", b"StepCompletes")
    payload = forged[12:]
    length = struct.pack("<I", len(payload))
    forged = b"DRJ1" + length + struct.pack("<I", zlib.crc32(length + payload)) + payload
    path.write_bytes(path.read_bytes() + forged)
    with pytest.raises(IntegrityError, match="does not decode"):
        recover(path)


# ---------------------------------------------------------------- model-based machine


@dataclass
class Model:
    """The controller state, written independently of ``records.apply``."""

    epoch: int = 0
    allocation: Allocation | None = None
    migration: str | None = None
    kind: MigrationKind | None = None
    target: Allocation | None = None
    ok_steps: frozenset[str] = frozenset()
    any_failed: bool = False
    steps_done: int = 0
    cursor: int = 0
    checkpoint: str | None = None

    def resolution(self) -> str:
        if self.migration is None:
            return "none"
        assert self.kind is not None
        forward = {str(s) for s in KIND_STEPS[self.kind][:-1]}
        return "roll_forward" if forward <= self.ok_steps and not self.any_failed else "roll_back"


class JournalMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory()
        self.path = Path(self._tmp.name) / "journal"
        self.model = Model()
        self.journal = Journal(self.path, job="machine")
        self.number = 0

    @initialize(alloc=allocations())
    def first_commit(self, alloc: Allocation) -> None:
        assert self.journal.commit(alloc) == 1
        self.model.epoch, self.model.allocation = 1, alloc

    @precondition(lambda self: self.model.migration is None)
    @rule(alloc=allocations())
    def commit(self, alloc: Allocation) -> None:
        self.journal.commit(alloc)
        self.model.epoch += 1
        self.model.allocation = alloc

    @precondition(lambda self: self.model.migration is None)
    @rule(kind=st.sampled_from(MigrationKind), goal=allocations())
    def begin(self, kind: MigrationKind, goal: Allocation) -> None:
        self.number += 1
        mid = f"m{self.number}"
        self.journal.begin_migration(
            migration_id=mid, kind=kind, component="trainer", devices=[0], target=goal,
            deadline=10.0,
        )  # fmt: skip
        self.model.migration, self.model.kind, self.model.target = mid, kind, goal
        self.model.ok_steps, self.model.any_failed = frozenset(), False

    @precondition(lambda self: self.model.migration is not None)
    @rule(data=st.data(), ok=st.booleans())
    def phase(self, data: st.DataObject, ok: bool) -> None:
        assert self.model.kind is not None and self.model.migration is not None
        step = str(data.draw(st.sampled_from(KIND_STEPS[self.model.kind])))
        self.journal.record_step(self.model.migration, step, ok=ok)
        if ok:
            self.model.ok_steps |= {step}
        else:
            self.model.any_failed = True

    @precondition(lambda self: self.model.migration is not None)
    @rule()
    def commit_migration(self) -> None:
        assert self.model.target is not None and self.model.migration is not None
        self.journal.commit(self.model.target, migration_id=self.model.migration)
        self.model.epoch += 1
        self.model.allocation, self.model.migration = self.model.target, None

    @precondition(lambda self: self.model.migration is not None)
    @rule(outcome=st.sampled_from(["rolled_back", "failed"]))
    def end(self, outcome: str) -> None:
        assert self.model.migration is not None
        self.journal.end_migration(self.model.migration, outcome)  # type: ignore[arg-type]
        self.model.migration = None

    @rule(alloc=allocations())
    def refused(self, alloc: Allocation) -> None:
        size = self.path.stat().st_size
        with pytest.raises(ValueError):
            if self.model.migration is None:
                self.journal.commit(alloc, migration_id="not-in-flight")
            else:
                self.journal.commit(alloc)
        assert self.path.stat().st_size == size

    @rule(advance=st.integers(0, 9))
    def step(self, advance: int) -> None:
        self.journal.complete_step(
            self.model.steps_done, cursor=self.model.cursor + advance, digest="d"
        )
        self.model.steps_done += 1
        self.model.cursor += advance

    @rule()
    def checkpoint(self) -> None:
        path = f"ckpt-{self.model.steps_done}"
        self.journal.record_checkpoint(
            steps_done=self.model.steps_done, path=path, version=1, cursor=self.model.cursor,
            digest="",
        )  # fmt: skip
        self.model.checkpoint = path

    @precondition(lambda self: self.model.steps_done > 0)
    @rule(back=st.integers(0, 3))
    def restore(self, back: int) -> None:
        steps = max(0, self.model.steps_done - back)
        cursor = self.model.cursor // 2
        self.journal.restored(steps_done=steps, cursor=cursor, path="any")
        self.model.steps_done, self.model.cursor = steps, cursor

    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """Kill the writer in the middle of a record: part of a frame reaches the disk."""
        self.journal.close()
        torn = frame(StepCompleted(step=self.model.steps_done, cursor=10**9, time=0.0))
        length = data.draw(st.integers(0, len(torn) - 1), label="torn bytes")
        with self.path.open("ab") as file:
            file.write(torn[:length])
        note(f"crash with {length} torn bytes")
        self.journal = Journal(self.path, job="machine")

    @invariant()
    def journal_matches_the_model(self) -> None:
        for state in (self.journal.state, recover(self.path)):
            assert state.epoch == self.model.epoch
            assert state.allocation == self.model.allocation
            flight = state.in_flight.migration_id if state.in_flight else None
            assert flight == self.model.migration
            assert state.resolution == self.model.resolution()
            assert (state.steps_done, state.cursor) == (self.model.steps_done, self.model.cursor)
            ckpt = state.checkpoint.path if state.checkpoint else None
            assert ckpt == self.model.checkpoint

    def teardown(self) -> None:
        self.journal.close()
        self._tmp.cleanup()


TestJournalMachine = JournalMachine.TestCase
# Every rule fsyncs: shorter runs keep the suite quick on a loaded machine.
TestJournalMachine.settings = settings(settings.default, stateful_step_count=20)


def test_the_journal_writes_exactly_these_frames(tmp_path: Path) -> None:
    records: list[JournalRecord] = [
        AllocationCommitted(epoch=1, allocation={"rollout": [0]}, time=0.0),
        StepCompleted(step=0, cursor=3, digest="d", time=0.0),
    ]
    with Journal(tmp_path / "journal", job="prop", clock=lambda: 0.0) as journal:
        for record in records:
            journal.append(record)
    assert (tmp_path / "journal").read_bytes() == b"".join(frame(r) for r in [_header(), *records])


def test_opening_a_missing_journal_writes_a_durable_header(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "journal"
    with pytest.raises(FileNotFoundError):
        Journal(path)
    os.makedirs(path.parent)
    with Journal(path, job="j") as journal:
        assert journal.state.started and journal.state.epoch == 0
    assert recover(path).started and recover(tmp_path / "absent") == JournalState()
