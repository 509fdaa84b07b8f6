"""Ledgers written when decision reasons were sentences still load, as typed reasons.

``tests/ledgers/prose-reasons-*.jsonl`` were written by the scheduler before reasons were
typed, with the ``.summary.txt`` and ``.summary.json`` that ``dynarl events`` prints for
them (every figure as it printed before reasons were typed): ``sim`` is the dynarl
policy's ledger of one simulated iteration of ``math-1.5b-64gpu`` (64 prompts, no
warm-up); ``scripted`` is a scheduler driven by hand
over the two-component graph of ``tests/sched_support.py`` through every hold, a failed
and a measured move, safe mode (failed moves, an operator, prediction error), observe-only,
a cost that eats the gain, a quota grant, a reclaim and three refusals.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from dynarl.bus import (
    CandidateReason,
    Commit,
    DecisionReason,
    DecisionRecord,
    FinishesLater,
    InfeasiblePlacement,
    LegacyReason,
    MinimumInterval,
    MoveInFlight,
    NoDonor,
    NoFeasibleReduction,
    NoMovableDonor,
    NotBetterAfterCost,
    ObserveOnly,
    QuotaRefused,
    Reclaim,
    Rejected,
    SafeMode,
    SavesLess,
)
from dynarl.sched import Ledger, format_summary, summarise_ledger, summary_json
from dynarl.sched._ledger_legacy import candidate_reason, decision_reason

LEDGERS = Path(__file__).parent.parent / "ledgers"
NAMES = ("sim", "scripted")


def fixture(name: str) -> Path:
    return LEDGERS / f"prose-reasons-{name}.jsonl"


def written_rounds(path: Path) -> dict[str, dict[str, Any]]:
    """Every decision round of the file as JSON, by id (the last line per id), runs
    expanded, reasons as the sentences written."""
    rounds: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "DecisionRecord":
            rounds[record["decision_id"]] = record
        elif record["type"] == "RoundsRecord":
            first = record["first"]
            for i, decision_id in enumerate(record["decision_ids"]):
                reason = record["reasons"][i] if record["reasons"] else first["reason"]
                rounds[decision_id] = {**first, "decision_id": decision_id, "reason": reason}
    return rounds


def decisions(ledger: Ledger) -> list[DecisionRecord]:
    return [r for r in ledger.query(kind="decision") if isinstance(r, DecisionRecord)]


@pytest.mark.parametrize("name", NAMES)
def test_an_old_ledger_reads_with_typed_reasons_that_say_what_it_said(name: str) -> None:
    path = fixture(name)
    ledger = Ledger.load(path)
    written = written_rounds(path)
    loaded = decisions(ledger)
    assert [d.decision_id for d in loaded] == sorted(written)
    for record in loaded:
        old = written[record.decision_id]
        assert record.committed == old["committed"]
        assert str(record.reason) == old["reason"]
        assert not isinstance(record.reason, LegacyReason), old["reason"]
        assert [str(c.reason) for c in record.rejected] == [c["reason"] for c in old["rejected"]]
        assert not any(isinstance(c.reason, LegacyReason) for c in record.rejected)


@pytest.mark.parametrize("name", NAMES)
def test_an_old_ledger_summarises_as_it_did(name: str) -> None:
    path = fixture(name)
    summary = summarise_ledger(Ledger.load(path))
    text = (LEDGERS / f"prose-reasons-{name}.summary.txt").read_text()
    document = (LEDGERS / f"prose-reasons-{name}.summary.json").read_text()
    assert format_summary(summary, source=path.name) + "\n" == text
    assert summary_json(summary, source=path.name) + "\n" == document


def test_the_rounds_of_the_simulated_ledger() -> None:
    ledger = Ledger.load(fixture("sim"))
    loaded = decisions(ledger)
    assert (len(loaded), sum(d.committed for d in loaded)) == (210, 5)
    kinds = Counter(
        type(d.reason.why).__name__ if isinstance(d.reason, Rejected) else type(d.reason).__name__
        for d in loaded
    )
    assert kinds == {
        "NoFeasibleReduction": 139,
        "MinimumInterval": 41,
        "MoveInFlight": 15,
        "NotBetterAfterCost": 7,
        "Commit": 5,
        "NoDonor": 3,
    }
    infinite = [
        d for d in loaded if isinstance(d.reason, Commit) and d.reason.gain_s == float("inf")
    ]
    assert [d.decision_id for d in infinite] == ["d000052", "d000066"]
    assert ledger.get("d000053").reason == MoveInFlight(decision_id="d000052")


def test_the_rounds_of_the_scripted_ledger() -> None:
    loaded = decisions(Ledger.load(fixture("scripted")))
    reasons = {type(d.reason) for d in loaded}
    assert reasons == {
        NoDonor,
        Commit,
        MoveInFlight,
        MinimumInterval,
        SafeMode,
        ObserveOnly,
        Rejected,
        Reclaim,
        QuotaRefused,
    }
    safe = {d.reason.why for d in loaded if isinstance(d.reason, SafeMode)}
    assert safe == {
        "maintenance",
        "2 consecutive failed moves",
        "prediction error of trainer is 0.90 > 0.3",
    }
    refused = [str(d.reason) for d in loaded if isinstance(d.reason, QuotaRefused)]
    assert refused == [
        "quota change to 41 devices refused: outside the job's elastic bounds",
        "quota change to 5 devices refused: outside the job's elastic bounds",
        "reclaim refused: rollout would fall below its minimum of 2 devices",
    ]
    (reclaim,) = [d for d in loaded if isinstance(d.reason, Reclaim)]
    assert reclaim.committed and reclaim.reason == Reclaim(num_devices=3)
    would = [d.reason for d in loaded if isinstance(d.reason, ObserveOnly)]
    assert would == [ObserveOnly(would=Commit(gain_s=10.5, cost_s=2.0, bottleneck="trainer"))] * 2


@pytest.mark.parametrize("name", NAMES)
def test_an_old_ledger_written_again_is_in_todays_form(name: str, tmp_path: Path) -> None:
    old = Ledger.load(fixture(name))
    with Ledger(tmp_path / "events.jsonl") as again:
        for record in old:
            again.append(record)
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert not any(
        isinstance(line.get("reason"), str) for line in lines if line["type"] == "DecisionRecord"
    )
    assert list(Ledger.load(tmp_path / "events.jsonl")) == list(old)


@pytest.mark.parametrize(
    ("sentence", "reason"),
    [
        ("hold: no donor", NoDonor()),
        ("hold: safe mode: a: b", SafeMode(why="a: b")),
        ("hold: move d000007 still in flight", MoveInFlight(decision_id="d000007")),
        ("hold: minimum interval between moves: 0.250 s to go", MinimumInterval(wait_s=0.25)),
        (
            "commit: saves 1.500 s net of 2.000 s migration; bottleneck trainer",
            Commit(gain_s=1.5, cost_s=2.0, bottleneck="trainer"),
        ),
        (
            "commit: saves all remaining work net of 2.000 s migration; bottleneck None",
            Commit(gain_s=float("inf"), cost_s=2.0, bottleneck=None),
        ),
        (
            "observe-only, would commit: saves 1.500 s net of 2.000 s migration; bottleneck t",
            ObserveOnly(would=Commit(gain_s=1.5, cost_s=2.0, bottleneck="t")),
        ),
        (
            "rejected: not better after cost: saves -inf s net of 3.000 s migration, "
            "needs more than 0.5 s",
            Rejected(why=NotBetterAfterCost(gain_s=-float("inf"), cost_s=3.0, min_gain_s=0.5)),
        ),
        (
            "rejected: infeasible placement: trainer needs whole TP groups inside single nodes",
            Rejected(
                why=InfeasiblePlacement(detail="trainer needs whole TP groups inside single nodes")
            ),
        ),
        ("rejected: no movable donor", Rejected(why=NoMovableDonor())),
        (
            "rejected: no feasible reduction reaches a higher throughput",
            Rejected(why=NoFeasibleReduction()),
        ),
        ("reclaim of 12 devices by the cluster", Reclaim(num_devices=12)),
        (
            "reclaim refused: trainer would fall below its minimum of 2 devices",
            QuotaRefused(
                detail="reclaim refused: trainer would fall below its minimum of 2 devices"
            ),
        ),
        ("hold: something new", LegacyReason(text="hold: something new")),
        ("rejected: for a new reason", LegacyReason(text="rejected: for a new reason")),
    ],
)
def test_each_sentence_of_a_round_becomes_its_struct(sentence: str, reason: DecisionReason) -> None:
    assert decision_reason(sentence) == reason
    assert str(reason) == sentence


@pytest.mark.parametrize(
    ("sentence", "reason"),
    [
        (
            "not better after cost: saves -0.000 s net of 0.000 s migration, needs more than 0.0 s",
            NotBetterAfterCost(gain_s=-0.0, cost_s=0.0, min_gain_s=0.0),
        ),
        (
            "saves 0.073 s, less than the chosen 0.111 s",
            SavesLess(gain_s=0.073, chosen_gain_s=0.111),
        ),
        (
            "finishes in 41.000 s, later than the chosen 40.000 s",
            FinishesLater(finish_s=41.0, chosen_finish_s=40.0),
        ),
        ("infeasible placement: x", InfeasiblePlacement(detail="x")),
        ("no movable donor", LegacyReason(text="no movable donor")),
    ],
)
def test_each_sentence_of_a_candidate_becomes_its_struct(
    sentence: str, reason: CandidateReason
) -> None:
    assert candidate_reason(sentence) == reason
    assert str(reason) == sentence
