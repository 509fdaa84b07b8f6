"""The ledger: JSONL sink, reload, queries, realised effects filled in later."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from dynarl.bus import Commit, DecisionRecord, MigrationRecord, NoDonor, SafeMode
from dynarl.sched import Ledger
from dynarl.sched._ledger_records import RoundsRecord


def decision(i: int, *, committed: bool, time: float, donor: str | None = None) -> DecisionRecord:
    return DecisionRecord(
        decision_id=f"d{i}",
        time=time,
        committed=committed,
        reason=Commit(gain_s=3.0, cost_s=0.0, bottleneck="trainer") if committed else NoDonor(),
        old_allocation={"rollout": 8, "trainer": 4},
        new_allocation={"rollout": 4, "trainer": 8} if committed else {"rollout": 8, "trainer": 4},
        donor=donor,
        receivers=("trainer",) if committed else (),
        predicted_bottleneck="trainer",
        expected_gain_s=3.0 if committed else 0.0,
    )


def migration(i: int, time: float, outcome: str = "committed") -> MigrationRecord:
    return MigrationRecord(
        migration_id=f"m{i}",
        decision_id="d2",
        time=time,
        kind="p2p",
        component="trainer",
        src_devices=(0, 1),
        dst_devices=(0, 1, 2, 3),
        outcome=outcome,
        bytes_moved=1 << 20,
        pause_s=0.4,
        cache_loss_tokens=0,
    )


def test_jsonl_round_trip_queries_and_late_fill(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with Ledger(path) as ledger:
        ledger.append(decision(1, committed=False, time=1.0))
        ledger.append(decision(2, committed=True, time=2.0, donor="rollout"))
        ledger.append(migration(1, 2.5))
        ledger.append(migration(2, 3.0, outcome="rolled_back"))
        updated = ledger.fill_realised("d2", realised_iteration_delta_s=-2.5, prediction_error=0.1)
        assert isinstance(updated, DecisionRecord) and updated.realised_iteration_delta_s == -2.5
        ledger.fill_realised("m1", realised_iteration_delta_s=-2.5, kind="migration")
        assert [r.time for r in ledger.query(since=2.0, until=2.9)] == [2.0, 2.5]
        assert ledger.query(kind="decision", committed=False) == [
            decision(1, committed=False, time=1.0)
        ]
        assert [r.migration_id for r in ledger.query(kind="migration", committed=False)] == ["m2"]  # type: ignore[union-attr]
        assert len(ledger.query(component="rollout")) == 1
        assert len(ledger.query(component="trainer")) == 4
        assert [r.time for r in ledger.query(reason="no donor")] == [1.0]
        with pytest.raises(ValueError, match="no decision record 'zz'"):
            ledger.fill_realised("zz", prediction_error=0.5)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 6  # four records and two late fills, append-only
    again = Ledger.load(path)
    assert len(again) == 4
    assert again.get("d2") == updated
    assert again.get("m1", kind="migration").realised_iteration_delta_s == -2.5  # type: ignore[union-attr]
    assert list(again) == again.query()


def test_load_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"type": "DecisionRecord"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: bad ledger record"):
        Ledger.load(path)


def test_async_context_manager_closes(tmp_path: Path) -> None:
    async def use() -> Ledger:
        async with Ledger(tmp_path / "a.jsonl") as ledger:
            ledger.append(decision(1, committed=False, time=0.0))
        return ledger

    ledger = asyncio.run(use())
    ledger.close()  # idempotent
    assert Ledger.load(tmp_path / "a.jsonl").get("d1").time == 0.0


def test_bounded_ledger_forgets_only_old_rounds_and_the_file_keeps_everything(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    with Ledger(path, keep_recent=3) as ledger:
        for i in range(1, 8):
            ledger.append(decision(i, committed=i == 2, time=float(i)))
        ledger.append(migration(1, 2.5))
        ledger.fill_realised("d2", realised_iteration_delta_s=-1.0)
        kept = [r.decision_id for r in ledger.query(kind="decision")]  # type: ignore[union-attr]
        assert kept == ["d2", "d5", "d6", "d7"]
        assert len(ledger.query(kind="migration")) == 1
        with pytest.raises(ValueError, match="no decision record 'd1'"):
            ledger.get("d1")
    again = Ledger.load(path)
    assert [r.decision_id for r in again.query(kind="decision")] == [  # type: ignore[union-attr]
        f"d{i}" for i in range(1, 8)
    ]
    assert again.get("d2").realised_iteration_delta_s == -1.0  # type: ignore[union-attr]


@pytest.mark.parametrize("keep", [0, -3])
def test_bounded_ledger_refuses_a_bad_bound(tmp_path: Path, keep: int) -> None:
    with pytest.raises(ValueError, match="keep_recent must be >= 1"):
        Ledger(tmp_path / "events.jsonl", keep_recent=keep)
    with pytest.raises(ValueError, match="needs a path"):
        Ledger(keep_recent=10)


def _types(path: Path) -> list[str]:
    return [json.loads(line)["type"] for line in path.read_text().splitlines()]


def test_consecutive_holds_are_one_line_and_load_back_as_every_round(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    rounds = [decision(i, committed=False, time=float(i)) for i in range(1, 6)]
    with Ledger(path) as ledger:
        for record in rounds[:3]:
            ledger.append(record)
        ledger.append(decision(9, committed=True, time=3.5))
        for record in rounds[3:]:
            ledger.append(record)
        # Memory sees every round at once; the pending run is not on disk yet.
        assert len(ledger.query(kind="decision")) == 6
        assert _types(path) == ["RoundsRecord", "DecisionRecord"]
    assert _types(path) == ["RoundsRecord", "DecisionRecord", "RoundsRecord"]
    loaded = Ledger.load(path).query(kind="decision")
    assert loaded == sorted([*rounds, decision(9, committed=True, time=3.5)], key=lambda r: r.time)


def test_a_run_is_written_every_max_rounds_and_a_lone_round_as_itself(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with Ledger(path, max_rounds_per_line=2) as ledger:
        for i in range(1, 6):
            ledger.append(decision(i, committed=False, time=float(i)))
        assert _types(path) == ["RoundsRecord", "RoundsRecord"]
        ledger.flush()
        assert _types(path) == ["RoundsRecord", "RoundsRecord", "DecisionRecord"]
    assert len(Ledger.load(path)) == 5
    with pytest.raises(ValueError, match="max_rounds_per_line must be >= 1"):
        Ledger(path, max_rounds_per_line=0)


def test_rounds_that_differ_in_more_than_their_columns_start_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    first = decision(1, committed=False, time=1.0)
    moved = msgspec.structs.replace(
        decision(2, committed=False, time=2.0), old_allocation={"rollout": 4, "trainer": 8}
    )
    renamed = msgspec.structs.replace(
        moved,
        decision_id="d3",
        time=3.0,
        reason=SafeMode(why="operator"),
        predicted_throughput_new=2.0,
    )
    with Ledger(path) as ledger:
        for record in (first, moved, renamed):
            ledger.append(record)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["type"] for line in lines] == ["DecisionRecord", "RoundsRecord"]
    assert lines[1]["reasons"] == [
        {"type": "NoDonor"},
        {"type": "SafeMode", "why": "operator"},
    ]
    assert lines[1]["throughput_old"] == [] and lines[1]["throughput_new"] == [0.0, 2.0]
    assert Ledger.load(path).query(kind="decision") == [first, moved, renamed]


def test_a_damaged_run_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    run = RoundsRecord(
        first=decision(1, committed=False, time=1.0), decision_ids=("d1", "d2"), times=(1.0,)
    )
    path.write_bytes(msgspec.json.encode(run) + b"\n")
    with pytest.raises(ValueError, match=r"events.jsonl:1: bad ledger record"):
        Ledger.load(path)
