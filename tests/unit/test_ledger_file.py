"""Reading a ledger file after a crash: a torn final line is skipped and counted, damage
anywhere else names its line, and an empty file or one that is not a ledger is one
sentence saying what it is (``Ledger.load`` and ``dynarl events``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from ledger_support import commit, hold, migration

from dynarl.bus import DecisionRecord
from dynarl.cli import main
from dynarl.sched import Ledger, format_summary, summarise_ledger


def decision(i: int, time: float, *, committed: bool = False) -> DecisionRecord:
    return commit(i, time) if committed else hold(i, time)


def written(path: Path) -> list[bytes]:
    """A ledger of three lines (a commit, its migration, a lone hold), as its lines."""
    with Ledger(path) as ledger:
        ledger.append(decision(1, 1.0, committed=True))
        ledger.append(migration("d1", 1.5))
        ledger.append(decision(2, 2.0))
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 3
    return lines


def crashed(path: Path, cut: int = 25) -> int:
    """The ledger of a job that stopped while writing a fourth line, ``cut`` bytes in;
    the bytes of the torn line."""
    lines = written(path)
    torn = lines[2][:cut]
    path.write_bytes(b"".join(lines) + torn)
    return len(torn)


def test_a_torn_final_line_is_skipped_and_its_bytes_counted(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    torn = crashed(path)
    ledger = Ledger.load(path)
    assert [r.time for r in ledger] == [1.0, 1.5, 2.0]  # every complete record
    assert ledger.file is not None
    assert (ledger.file.num_lines, ledger.file.skipped_bytes) == (3, torn)
    path.write_bytes(path.read_bytes()[:-torn])
    whole = Ledger.load(path).file
    assert whole == dataclasses.replace(ledger.file, skipped_bytes=0)


def test_only_the_final_unterminated_line_is_forgiven(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lines = written(path)
    torn = lines[2][:25]
    path.write_bytes(b"".join(lines) + torn)
    assert len(Ledger.load(path)) == 3
    path.write_bytes(b"".join(lines) + torn + b"\n")  # ended: not a write cut off
    with pytest.raises(ValueError, match=r"events\.jsonl:4: bad ledger record"):
        Ledger.load(path)
    path.write_bytes(lines[0] + torn + b"\n" + lines[1] + lines[2])
    with pytest.raises(ValueError, match=r"events\.jsonl:2: bad ledger record"):
        Ledger.load(path)
    # A first line of a ledger record's type is a damaged ledger, not another kind of file.
    path.write_bytes(b'{"type": "DecisionRecord", "decision_id": 3}\n' + b"".join(lines))
    with pytest.raises(ValueError, match=r"events\.jsonl:1: bad ledger record"):
        Ledger.load(path)


def test_dynarl_events_reads_a_crashed_run_and_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torn = crashed(tmp_path / "events.jsonl")
    assert main(["events", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert f"skipped its {torn} bytes and read the 3 complete lines before it" in err
    assert out.startswith(f"ledger {tmp_path / 'events.jsonl'}: 3 lines: 2 decisions, 1 migration")
    assert f"a torn last line of {torn} bytes skipped" in out
    assert main(["events", str(tmp_path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["file"]["skipped_bytes"] == torn and document["num_rounds"] == 2


def test_an_empty_ledger_is_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"")
    assert main(["events", str(path)]) == 0
    assert capsys.readouterr().out == (
        f"{path} is empty: no records were written (the job wrote nothing, or not to this file)\n"
    )
    only = written(path)[0]
    path.write_bytes(only[:40])  # the job stopped while writing its first record
    summary = summarise_ledger(Ledger.load(path))
    assert format_summary(summary, source="x.jsonl") == (
        "x.jsonl holds no complete record: its only line was cut off after 40 bytes (the "
        "job stopped while writing its first record)"
    )


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (b"hello world\n", "its first line is not JSON ('hello world')"),
        (b"hello", "its first line is not JSON ('hello')"),
        (
            b'{"name": "a", "version": 1}\n{"name": "b", "version": 2}\n',
            "its first line is a JSON object with keys 'name', 'version', not a ledger record",
        ),
        (b'{"type": "Foo", "x": 1}\n', "its first line is a JSON object of type 'Foo'"),
        (b"[1, 2]\n", "its first line is a JSON list of 2 items"),
        (
            json.dumps({"source": "x", "num_rounds": 3}, indent=2).encode(),
            "it is one JSON document (a JSON object with keys 'source', 'num_rounds'), "
            "not one record per line",
        ),
    ],
)
def test_a_file_that_is_not_a_ledger_says_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, what: str
) -> None:
    path = tmp_path / "other.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a dynarl ledger") as raised:
        Ledger.load(path)
    assert what in str(raised.value)
    assert main(["events", str(path)]) == 2
    assert capsys.readouterr().err == f"dynarl events: {raised.value}\n"


def test_a_job_restarted_on_a_crashed_ledger_cuts_the_torn_line_and_appends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "events.jsonl"
    torn = crashed(path)
    with Ledger(path) as ledger:  # the restarted job's writer
        ledger.append(decision(3, 3.0))
    assert f"cut its {torn} bytes off" in caplog.text
    reread = Ledger.load(path)
    assert [r.time for r in reread] == [1.0, 1.5, 2.0, 3.0]
    assert reread.file is not None and reread.file.skipped_bytes == 0


def test_a_whole_last_record_missing_its_newline_is_kept_on_restart(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(written(path)).rstrip(b"\n"))
    with Ledger(path) as ledger:
        ledger.append(decision(3, 3.0))
    assert [r.time for r in Ledger.load(path)] == [1.0, 1.5, 2.0, 3.0]


def test_dynarl_events_piped_into_a_reader_that_stops_early_ends_quietly(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    with Ledger(path) as ledger:
        for i in range(1500):  # a row per move: far more than a pipe's 64 KiB buffer
            ledger.append(decision(i, float(i), committed=True))
    # `dynarl events events.jsonl | head -n 1`: the reader closes the pipe after one line.
    script = "import sys; from dynarl.cli import main; sys.exit(main(sys.argv[1:]))"
    with subprocess.Popen(
        [sys.executable, "-c", script, "events", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as events:
        assert events.stdout is not None and events.stderr is not None
        events.stdout.readline()
        events.stdout.close()
        stderr = events.stderr.read().decode()
        assert events.wait(timeout=60) == 141
    assert "Traceback" not in stderr
