"""``dynarl events``: the ledger summary on a hand-written ledger (exact figures), on a
simulator's ledger (consistency), its text and JSON forms, the charts, and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
from sim_support import small

from dynarl.bus import (
    CandidateReason,
    Commit,
    DecisionReason,
    DecisionRecord,
    FinishesLater,
    InfeasiblePlacement,
    LegacyReason,
    MigrationRecord,
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
    RejectedCandidate,
    SafeMode,
    SavesLess,
)
from dynarl.cli import main
from dynarl.sched import (
    Ledger,
    LedgerRecord,
    SafeModeRecord,
    format_summary,
    plot_ledger,
    summarise_ledger,
    summary_json,
)
from dynarl.sched._ledger_records import ComponentObservation, ObservationRecord
from dynarl.sched._series import ledger_series
from dynarl.sched._summary import reason_category
from dynarl.sim import Simulation
from dynarl.sim.policies import DynarlPolicy

ALLOC = {"rollout": 8, "trainer": 4}


def decision(i: int, t: float, reason: DecisionReason, **fields: object) -> DecisionRecord:
    committed = isinstance(reason, Commit)
    new = {"rollout": 4, "trainer": 8} if committed else ALLOC
    return DecisionRecord(
        decision_id=f"d{i}",
        time=t,
        committed=committed,
        reason=reason,
        old_allocation=ALLOC,
        new_allocation=new,
        **fields,  # type: ignore[arg-type]
    )


def migration(
    i: int, decision_id: str, t: float, kind: str, component: str, **fields: object
) -> MigrationRecord:
    return MigrationRecord(
        migration_id=f"m{i}",
        decision_id=decision_id,
        time=t,
        kind=kind,
        component=component,
        src_devices=(0,),
        dst_devices=(0, 1),
        **fields,  # type: ignore[arg-type]
    )


def observation(i: int, t: float, iteration: int, utilization: float) -> ObservationRecord:
    seen = ComponentObservation(
        devices=8,
        utilization=utilization,
        queue_depth=2,
        throughput=10.0,
        predicted_throughput=12.0,
        remaining=100,
        iteration=iteration,
    )
    return ObservationRecord(record_id=f"d{i}", time=t, components={"rollout": seen})


def ledger() -> list[LedgerRecord]:
    reject = [
        RejectedCandidate(
            allocation={},
            predicted_throughput=1.0,
            reason=SavesLess(gain_s=x, chosen_gain_s=3.0),
        )
        for x in (0.5, 1.5)
    ]
    return [
        decision(1, 1.0, NoDonor()),
        decision(
            2,
            2.0,
            Rejected(why=NotBetterAfterCost(gain_s=-0.2, cost_s=1.0, min_gain_s=0.0)),
            rejected=tuple(reject),
        ),
        decision(
            3,
            3.0,
            Commit(gain_s=3.0, cost_s=1.0, bottleneck="trainer"),
            expected_gain_s=3.0,
            migration_cost_s=1.0,
            migration_bytes=5000,
            realised_iteration_delta_s=-2.0,
            prediction_error=0.1,
        ),
        migration(
            1, "d3", 4.0, "p2p", "trainer", outcome="committed", bytes_moved=1000, pause_s=0.4
        ),
        migration(
            2,
            "d3",
            4.5,
            "workload",
            "rollout",
            outcome="committed",
            pause_s=1.5,
            cache_loss_tokens=300,
        ),
        decision(4, 5.0, MoveInFlight(decision_id="d000003")),
        decision(
            5,
            12.0,
            Commit(gain_s=math.inf, cost_s=2.0, bottleneck="trainer"),
            expected_gain_s=math.inf,
            migration_cost_s=2.0,
        ),
        migration(
            3, "d5", 13.0, "p2p", "trainer", outcome="rolled_back", reason="peer lost", pause_s=0.7
        ),
        migration(4, "op000001", 14.0, "workload", "rollout", outcome="committed", pause_s=0.1),
        SafeModeRecord(record_id="s1", time=10.0, safe=True, reason="3 consecutive failed moves"),
        SafeModeRecord(record_id="s2", time=15.0, safe=False, reason="cool-down over"),
        SafeModeRecord(record_id="s3", time=20.0, safe=True, reason="maintenance", operator=True),
        decision(6, 25.0, SafeMode(why="maintenance")),
        observation(1, 1.0, 0, 0.5),
        observation(2, 2.0, 0, 0.7),
        observation(6, 25.0, 1, 0.9),
    ]


def test_summary_figures_of_a_hand_written_ledger() -> None:
    s = summarise_ledger(ledger())
    assert (s.start, s.end, s.num_rounds, s.num_committed, s.operator_moves) == (1.0, 25.0, 6, 2, 1)
    first, second = s.moves
    assert first.status == "measured" and first.realised_gain_s == 2.0
    assert first.prediction_error == 0.1 and first.predicted_bytes == 5000
    assert first.bytes_moved == 1000 and first.pause_s == 1.5 and first.cache_loss_tokens == 300
    assert first.migrations == ("p2p:trainer:committed", "workload:rollout:committed")
    assert second.status == "failed" and math.isinf(second.predicted_gain_s)
    assert (s.predicted_gain_s, s.realised_gain_s) == (3.0, 2.0)
    by_key = {(m.kind, m.component): m for m in s.migrations}
    p2p, workload = by_key[("p2p", "trainer")], by_key[("workload", "rollout")]
    assert (p2p.committed, p2p.rolled_back, p2p.bytes_moved, p2p.pause_max_s) == (1, 1, 1000, 0.7)
    assert (workload.committed, workload.cache_loss_tokens) == (2, 300)
    assert math.isclose(s.pause_total_s, 0.4 + 1.5 + 0.7 + 0.1)
    assert s.rounds_by_reason == {
        "hold: no donor": 1,
        "rejected: not better after cost": 1,
        "hold: move # still in flight": 1,
        "hold: safe mode": 1,
    }
    assert s.rejected_by_reason == {"saves # s, less than the chosen # s": 2}
    assert [(e.start, e.end, e.duration_s) for e in s.safe_mode] == [
        (10.0, 15.0, 5.0),
        (20.0, None, 5.0),
    ]
    assert s.safe_mode_s == 10.0
    assert [(i.iteration, i.start, i.end, i.complete, i.moves) for i in s.iterations] == [
        (0, 1.0, 25.0, True, 2),
        (1, 25.0, 25.0, False, 0),
    ]
    (rollout,) = s.components
    assert math.isclose(rollout.mean_utilization, 0.7)
    assert rollout.throughput_error is not None and math.isclose(
        rollout.throughput_error.median, 0.2
    )


def test_text_and_json_forms() -> None:
    s = summarise_ledger(ledger())
    text = format_summary(s, source="run/events.jsonl")
    assert text.startswith(
        "ledger run/events.jsonl: 16 records: 6 decisions, 4 migrations, "
        "3 safe-mode transitions, 3 observations\nover 24.0 s"
    )
    for heading in (
        "Moves",
        "Migrations by kind and component",
        "Gain",
        "Prediction error",
        "Safe mode: 10.0 s in 2 episode(s)",
        "Rejected candidates, by reason",
    ):
        assert heading in text
    assert "rollout 8->4, trainer 4->8" in text
    document = json.loads(summary_json(s, source="x"))
    assert document["source"] == "x" and document["num_committed"] == 2
    assert document["moves"][1]["predicted_gain_s"] is None  # infinite: JSON has no inf
    assert document["moves"][0]["realised_gain_s"] == 2.0


COMMIT = Commit(gain_s=2.0, cost_s=0.5, bottleneck="trainer")


@pytest.mark.parametrize(
    ("reason", "sentence", "category"),
    [
        (NoDonor(), "hold: no donor", "hold: no donor"),
        (
            MinimumInterval(wait_s=1.5),
            "hold: minimum interval between moves: 1.500 s to go",
            "hold: minimum interval between moves",
        ),
        (
            SafeMode(why="prediction error of trainer is 0.91 > 0.5"),
            "hold: safe mode: prediction error of trainer is 0.91 > 0.5",
            "hold: safe mode",
        ),
        (
            MoveInFlight(decision_id="d000012"),
            "hold: move d000012 still in flight",
            "hold: move # still in flight",
        ),
        (
            COMMIT,
            "commit: saves 2.000 s net of 0.500 s migration; bottleneck trainer",
            "commit",
        ),
        (
            ObserveOnly(would=COMMIT),
            "observe-only, would commit: saves 2.000 s net of 0.500 s migration; "
            "bottleneck trainer",
            "observe-only, would commit",
        ),
        (
            Rejected(why=InfeasiblePlacement(detail="trainer needs 4 devices on one node")),
            "rejected: infeasible placement: trainer needs 4 devices on one node",
            "rejected: infeasible placement",
        ),
        (
            Rejected(why=NoMovableDonor()),
            "rejected: no movable donor",
            "rejected: no movable donor",
        ),
        (
            Rejected(why=NoFeasibleReduction()),
            "rejected: no feasible reduction reaches a higher throughput",
            "rejected: no feasible reduction reaches a higher throughput",
        ),
        (
            QuotaRefused(
                detail="quota change to 12 devices refused: outside the job's elastic bounds"
            ),
            "quota change to 12 devices refused: outside the job's elastic bounds",
            "quota change to # devices refused",
        ),
        (
            Reclaim(num_devices=3),
            "reclaim of 3 devices by the cluster",
            "reclaim of # devices by the cluster",
        ),
        (
            NotBetterAfterCost(gain_s=-0.25, cost_s=1.0, min_gain_s=0.5),
            "not better after cost: saves -0.250 s net of 1.000 s migration, needs more than 0.5 s",
            "not better after cost",
        ),
        (
            SavesLess(gain_s=0.2, chosen_gain_s=0.3),
            "saves 0.200 s, less than the chosen 0.300 s",
            "saves # s, less than the chosen # s",
        ),
        (
            FinishesLater(finish_s=41.0, chosen_finish_s=40.0),
            "finishes in 41.000 s, later than the chosen 40.000 s",
            "finishes in # s, later than the chosen # s",
        ),
        (
            LegacyReason(text="hold: warming up: 3 s left"),
            "hold: warming up: 3 s left",
            "hold: warming up",
        ),
    ],
)
def test_each_reason_renders_its_sentence_and_is_counted_by_its_category(
    reason: DecisionReason | CandidateReason, sentence: str, category: str
) -> None:
    assert str(reason) == sentence
    assert reason_category(reason) == category == reason.category


def simulated(tmp_path: Path) -> Path:
    """The dynarl policy's ledger of a small simulated job, written as a run directory."""
    policy = DynarlPolicy()
    sim = Simulation(small(), request_policy=policy.request_policy)
    sim.run(policy)
    assert policy.scheduler is not None
    with Ledger(tmp_path / "events.jsonl") as out:
        for record in policy.scheduler.ledger:
            out.append(record)
    return tmp_path


def test_a_simulated_ledger_adds_up(tmp_path: Path) -> None:
    ledger = Ledger.load(simulated(tmp_path) / "events.jsonl")
    s = summarise_ledger(ledger)
    decisions = ledger.query(kind="decision")
    assert s.num_rounds == len(decisions) and s.num_committed >= 2
    assert s.num_committed + sum(s.rounds_by_reason.values()) == s.num_rounds
    migrations = ledger.query(kind="migration")
    assert sum(m.committed + m.rolled_back + m.failed for m in s.migrations) == len(migrations)
    assert {m.status for m in s.moves} <= {"measured", "superseded", "open"}
    assert sum(m.status == "measured" for m in s.moves) >= 1
    assert {c.component for c in s.components} == {"rollout", "inference", "trainer"}
    assert [i.iteration for i in s.iterations] == [0, 1]
    series = ledger_series(ledger)
    assert len(series.times) == s.num_rounds
    # Seconds after the first record, as the summary's times (not the job's clock).
    assert series.origin == min(r.time for r in ledger)
    assert series.times[0] == decisions[0].time - series.origin >= 0.0
    assert all(0.0 <= t <= series.times[-1] for t in series.iteration_starts + series.move_times)
    total = [sum(column) for column in zip(*series.devices.values(), strict=True)]
    assert set(total) == {16.0}  # every device is held or free at every round


def test_cli_events_text_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = simulated(tmp_path)
    assert main(["events", str(run)]) == 0
    text = capsys.readouterr().out
    assert "committed moves" in text and "Migrations by kind and component" in text
    assert main(["events", str(run / "events.jsonl"), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["num_rounds"] > 0 and document["moves"]
    assert main(["events", str(run), "--plot"]) == 0
    out = capsys.readouterr().out
    names = sorted(p.name for p in (run / "plots").iterdir())
    assert names == ["allocation.png", "moves.png", "throughput.png", "utilization.png"]
    assert all((run / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    assert "plots: " in out
    assert main(["events", str(tmp_path / "missing")]) == 2


def test_plot_ledger_draws_without_observations(tmp_path: Path) -> None:
    bare = [r for r in ledger() if not isinstance(r, ObservationRecord)]
    paths = plot_ledger(bare, tmp_path, title="bare")
    assert [p.name for p in paths] == [
        "allocation.png",
        "utilization.png",
        "throughput.png",
        "moves.png",
    ]


def test_the_charts_count_time_from_the_first_record_as_the_summary_does() -> None:
    # A job's ledger carries its clock (monotonic seconds, ~9600 here): the charts' axis
    # starts at the first record, as the summary's times do.
    shifted = [msgspec.structs.replace(r, time=r.time + 9600.0) for r in ledger()]
    plain, moved = ledger_series(ledger()), ledger_series(shifted)
    assert moved.origin == plain.origin + 9600.0
    assert moved.times == pytest.approx(plain.times)
    assert moved.move_times == pytest.approx(plain.move_times)
    assert moved.times[0] == 0.0 and max(moved.times) < 9600.0
