"""The ledger's lean file (runs of uncommitted rounds as one line) loses nothing: any
sequence of records written and loaded back gives the same records — the same committed
and uncommitted decisions, the same rounds per reason, the same summary counts."""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from pathlib import Path

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from dynarl.bus import (
    Commit,
    DecisionReason,
    DecisionRecord,
    MigrationRecord,
    MinimumInterval,
    NoDonor,
    NotBetterAfterCost,
    Rejected,
    SafeMode,
)
from dynarl.sched import Ledger, LedgerRecord, summarise_ledger
from dynarl.sched._ledger_records import ObservationRecord

THROUGHPUT = st.sampled_from([0.0, -0.0, 1.5, math.inf, math.nan]) | st.floats(0.0, 10.0)
GAIN = st.sampled_from([0.0, -0.0, -1.5, -math.inf, math.nan]) | st.floats(-10.0, 0.0)
REASONS: st.SearchStrategy[DecisionReason] = st.sampled_from(
    [NoDonor(), MinimumInterval(wait_s=0.5), SafeMode(why="operator")]
) | st.builds(
    lambda gain: Rejected(why=NotBetterAfterCost(gain_s=gain, cost_s=1.0, min_gain_s=0.0)), GAIN
)
ALLOCATIONS = st.sampled_from([{"rollout": 2, "trainer": 1}, {"rollout": 1, "trainer": 2}])


@st.composite
def decisions(draw: st.DrawFn, i: int) -> DecisionRecord:
    committed = draw(st.integers(0, 4)) == 0
    allocation = draw(ALLOCATIONS)
    return DecisionRecord(
        decision_id=f"d{i:06d}",
        time=float(i),
        committed=committed,
        reason=Commit(gain_s=1.0, cost_s=0.0, bottleneck="trainer") if committed else draw(REASONS),
        old_allocation=allocation,
        new_allocation=allocation,
        donor=draw(st.sampled_from([None, "rollout"])),
        predicted_throughput_old=draw(THROUGHPUT),
        predicted_throughput_new=draw(THROUGHPUT),
    )


@st.composite
def ledgers(draw: st.DrawFn) -> list[LedgerRecord]:
    """Decision rounds (each after its observation), now and then a migration."""
    out: list[LedgerRecord] = []
    for i in range(1, draw(st.integers(0, 40)) + 1):
        out.append(ObservationRecord(record_id=f"d{i:06d}", time=float(i), components={}))
        out.append(draw(decisions(i)))
        if draw(st.integers(0, 9)) == 0:
            out.append(_migration(i))
    return out


def _migration(i: int) -> MigrationRecord:
    return MigrationRecord(
        migration_id=f"m{i}", decision_id=f"d{i:06d}", time=i + 0.5, kind="p2p",
        component="trainer", src_devices=(2,), dst_devices=(1, 2), outcome="committed",
    )  # fmt: skip


def _line(record: LedgerRecord | DecisionReason) -> bytes:
    """What a record (or reason) says (NaN != NaN, so they are compared by their encoding)."""
    return msgspec.msgpack.encode(record)


@given(records=ledgers(), per_line=st.integers(1, 6))
def test_written_then_loaded_gives_the_same_records(
    records: list[LedgerRecord], per_line: int
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "events.jsonl"
        with Ledger(path, max_rounds_per_line=per_line) as live:
            for record in records:
                live.append(record)
            in_memory = live.query()
        loaded = Ledger.load(path).query()
        num_lines = len(path.read_text().splitlines())
    assert sorted(map(_line, loaded)) == sorted(map(_line, in_memory))
    assert sorted(map(_line, loaded)) == sorted(map(_line, records))
    decided = [r for r in loaded if isinstance(r, DecisionRecord)]
    written = [r for r in records if isinstance(r, DecisionRecord)]
    assert Counter((d.decision_id, d.committed) for d in decided) == Counter(
        (d.decision_id, d.committed) for d in written
    )
    holds = Counter(_line(d.reason) for d in written if not d.committed)
    assert Counter(_line(d.reason) for d in decided if not d.committed) == holds
    before, after = summarise_ledger(records), summarise_ledger(loaded)
    assert (after.num_rounds, after.num_committed) == (before.num_rounds, before.num_committed)
    assert after.rounds_by_reason == before.rounds_by_reason
    assert num_lines <= len(records)
