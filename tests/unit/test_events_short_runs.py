"""The ledger summary of a short run: the file's lines by kind, a run of holds counted as
one line of several rounds, and every iteration listed, even one no decision round saw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ledger_support import commit, hold, migration

from dynarl.cli import main
from dynarl.sched import Ledger, LedgerRecord, format_summary, summarise_ledger
from dynarl.sched._ledger_records import ComponentObservation, ObservationRecord


def observed(i: int, time: float, iteration: int) -> ObservationRecord:
    seen = ComponentObservation(
        devices=2,
        utilization=0.5,
        queue_depth=0,
        throughput=1.0,
        predicted_throughput=1.0,
        remaining=3,
        iteration=iteration,
    )
    return ObservationRecord(record_id=f"d{i}", time=time, components={"rollout": seen})


def test_the_header_counts_the_files_lines_by_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "events.jsonl"
    with Ledger(path) as ledger:
        for i in (1, 2, 3):
            ledger.append(hold(i, float(i)))
        ledger.append(commit(4, 4.0))
        ledger.append(migration("d4", 4.5))
        ledger.append(hold(5, 5.0))
        ledger.append(hold(6, 6.0))
        ledger.fill_realised("d4", realised_iteration_delta_s=-0.5)
    assert len(path.read_bytes().splitlines()) == 5
    assert main(["events", str(path)]) == 0
    header = capsys.readouterr().out.splitlines()[:2]
    assert header == [
        f"ledger {path}: 5 lines: 1 decision, 2 hold runs (5 holds), 1 migration, "
        "1 update (a record written again, its realised effect filled in)",
        "over 5.0 s (clock 1.0 to 6.0 s; times below are from the first record): "
        "6 decision rounds, 1 committed move",
    ]
    assert main(["events", str(path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["records_by_kind"] == {"decision": 6, "migration": 1}
    assert document["file"] == {
        "num_lines": 5,
        "lines_by_kind": {"decision": 1, "rounds": 2, "migration": 1},
        "num_run_rounds": 5,
        "num_updates": 1,
        "skipped_bytes": 0,
    }


def test_records_not_read_from_a_file_are_counted_by_kind() -> None:
    summary = summarise_ledger([hold(1, 1.0), commit(2, 2.0), migration("d2", 2.5)])
    assert format_summary(summary, source="memory").splitlines()[0] == (
        "ledger memory: 3 records: 2 decisions, 1 migration"
    )


def test_every_iteration_is_listed_even_one_no_round_saw() -> None:
    # Three iterations; the second began and ended between the rounds at 3 s and 4 s.
    seen = [(1, 0), (2, 0), (3, 0), (4, 2), (5, 2)]
    records: list[LedgerRecord] = [observed(i, float(i), it) for i, it in seen]
    records += [hold(i, float(i)) for i in (1, 2, 3, 5)] + [commit(4, 4.0)]
    summary = summarise_ledger(records)
    assert [i.iteration for i in summary.iterations] == [0, 1, 2]
    spans = [
        (i.iteration, i.start, i.end, i.complete, i.num_rounds, i.moves) for i in summary.iterations
    ]
    assert spans == [
        (0, 1.0, 3.0, True, 3, 0),
        (1, 3.0, 4.0, True, 0, 0),  # bounded by the rounds around it
        (2, 4.0, 5.0, False, 2, 1),
    ]
    text = format_summary(summary, source="x")
    table = text[text.index("Iterations") :].splitlines()[1:5]
    assert [row.split()[0] for row in table] == ["iteration", "0", "1", "2"]
    assert "< 1.0 s" in table[2]
    assert any("no decision round saw iteration(s) 1" in note for note in summary.notes)
