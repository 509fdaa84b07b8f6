"""What the scheduler writes to the ledger beside its decisions: safe-mode transitions,
round observations and the realised effect of moves; and ledgers with infinite gains."""

from __future__ import annotations

import math
from pathlib import Path

from sched_support import PowerLawPredictor, report

from dynarl.bus import Commit, ComponentReport, DecisionRecord
from dynarl.sched import (
    HyperNode,
    Ledger,
    ManualClock,
    MigrationCommand,
    MoveOutcome,
    OperatorCommand,
    SafeModeRecord,
    Scheduler,
    SchedulerConfig,
    StaticMigrationCost,
    summarise_ledger,
)
from dynarl.sched._ledger_records import ObservationRecord
from dynarl.types import Allocation, ComponentKind, MigrationKind

NODES = {
    "rollout": HyperNode(name="rollout", kind=ComponentKind.ROLLOUT, min_devices=2),
    "trainer": HyperNode(
        name="trainer", kind=ComponentKind.TRAINER, migration=MigrationKind.P2P, tp=2
    ),
}
START = Allocation.of({"rollout": range(0, 12), "trainer": range(12, 16)})


def make(path: Path | None = None, **config: object) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    settings = {"num_devices_per_node": 4, "min_move_interval_s": 0.0} | config
    scheduler = Scheduler(
        graph=NODES,
        allocation=START,
        predictor=PowerLawPredictor({"rollout": (100.0, 0.9, 4.0), "trainer": (10.0, 1.0, 0.0)}),
        cost=StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 1.0, MigrationKind.P2P: 2.0}),
        clock=clock,
        config=SchedulerConfig(**settings),  # type: ignore[arg-type]
        ledger=Ledger(path),
    )
    return scheduler, clock


def step(
    s: Scheduler, clock: ManualClock, *, iteration: int = 0, idle: str = "rollout"
) -> list[MigrationCommand]:
    """One second in which the ``idle`` component idles in its tail and the other is fed."""
    t = clock.advance(1.0)
    rollout_idle, trainer_idle = idle == "rollout", idle == "trainer"
    reports: list[ComponentReport] = [
        report(
            "rollout",
            time=t,
            utilization=(0.05 if rollout_idle else 0.9,) * s.allocation.count("rollout"),
            remaining=8 if rollout_idle else 4000,
            throughput=2.0,
            iteration=iteration,
        ),
        report(
            "trainer",
            kind="trainer",
            time=t,
            utilization=(0.05 if trainer_idle else 1.0,) * (s.allocation.count("trainer") // 2),
            remaining=10 if trainer_idle else 1000,
            queue_depth=0 if trainer_idle else 50,
            throughput=40.0,
            iteration=iteration,
        ),
    ]
    return [c for r in reports for c in s.handle(r)]


def finish(s: Scheduler, command: MigrationCommand, ok: bool = True) -> None:
    allocation = command.new_allocation if ok else command.old_allocation
    s.handle(MoveOutcome(decision_id=command.decision_id, ok=ok, allocation=allocation))


def committed(ledger: Ledger) -> list[DecisionRecord]:
    return [
        r for r in ledger.query(kind="decision", committed=True) if isinstance(r, DecisionRecord)
    ]


def test_safe_mode_episodes_are_recorded_and_summarised() -> None:
    s, clock = make(max_failed_moves=1, safe_mode_cooldown_s=5.0)
    commands: list[MigrationCommand] = []
    while not commands:
        commands = step(s, clock)
    finish(s, commands[0], ok=False)  # one failure is enough: safe mode at t=4
    for _ in range(7):
        step(s, clock)  # the cool-down ends at the round of t=9
    s.handle(OperatorCommand(action="enter_safe_mode", reason="maintenance"))
    step(s, clock)
    s.handle(OperatorCommand(action="leave_safe_mode", reason="done"))
    transitions = [r for r in s.ledger.query(kind="safety") if isinstance(r, SafeModeRecord)]
    assert [(r.time, r.safe, r.operator) for r in transitions] == [
        (4.0, True, False),
        (9.0, False, False),
        (11.0, True, True),
        (12.0, False, True),
    ]
    assert "1 consecutive failed moves" in transitions[0].reason
    assert transitions[1].reason == "cool-down of 5.0 s over"
    assert transitions[2].reason == "maintenance" and transitions[3].reason == "operator: done"
    summary = summarise_ledger(s.ledger)
    assert summary.safe_mode_s == 5.0 + 1.0
    assert [e.operator for e in summary.safe_mode] == [False, True]
    assert summary.moves[0].status == "failed"


def test_every_round_is_observed_under_its_decision_id() -> None:
    s, clock = make()
    for _ in range(3):
        step(s, clock)
    rounds = s.ledger.query(kind="decision")
    observed = s.ledger.query(kind="observation")
    assert [r.decision_id for r in rounds] == [o.record_id for o in observed]  # type: ignore[union-attr]
    last = observed[-1]
    assert isinstance(last, ObservationRecord)
    trainer = last.components["trainer"]
    assert trainer.devices == 4 and trainer.throughput == 40.0 and trainer.queue_depth == 50
    assert trainer.predicted_throughput == 40.0  # 10 · 4¹ from the oracle predictor
    assert math.isclose(last.components["rollout"].utilization, 0.05)


def test_every_move_of_an_iteration_is_measured_by_the_time_the_next_begins() -> None:
    """Each committed move is measured on its own (issue 23: before, only an iteration's
    last move was), against the work it knew of (``dynarl/sched/_effects.py``)."""
    s, clock = make(min_move_interval_s=0.0)
    first: list[MigrationCommand] = []
    while not first:
        first = step(s, clock)
    finish(s, first[0])
    second: list[MigrationCommand] = []
    for _ in range(30):
        second = step(s, clock, idle="trainer")
        if second:
            break
    assert second, "now the trainer idles and rollout is the bottleneck: a second move"
    finish(s, second[0])
    step(s, clock, idle="trainer")
    t_decided = second[0].time
    step(s, clock, iteration=1, idle="trainer")  # the iteration ended during this interval
    end = clock.now()
    early, late = committed(s.ledger)
    for move in (early, late):
        assert move.prediction_error is not None and move.realised_iteration_delta_s is not None
    # The last move's work ran to the iteration's end.
    predicted = 1.0 / late.predicted_throughput_new + late.migration_cost_s
    assert math.isclose(late.prediction_error, (end - t_decided) / predicted - 1.0)
    summary = summarise_ledger(s.ledger)
    assert [m.status for m in summary.moves] == ["measured", "measured"]
    for move, record in zip(summary.moves, (early, late), strict=True):
        assert move.realised_gain_s == -record.realised_iteration_delta_s
    assert summary.prediction_error is not None and summary.prediction_error.count == 2
    assert [i.iteration for i in summary.iterations] == [0, 1]


def test_a_failed_move_is_not_measured() -> None:
    s, clock = make()
    commands: list[MigrationCommand] = []
    while not commands:
        commands = step(s, clock)
    finish(s, commands[0], ok=False)
    step(s, clock, iteration=1)
    record = committed(s.ledger)[0]
    assert record.decision_id == commands[0].decision_id
    assert record.prediction_error is None and record.realised_iteration_delta_s is None


def test_infinite_gains_survive_the_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    record = DecisionRecord(
        decision_id="d1",
        time=1.0,
        committed=True,
        reason=Commit(gain_s=math.inf, cost_s=1.0, bottleneck=None),
        old_allocation={"rollout": 4, "trainer": 0},
        new_allocation={"rollout": 2, "trainer": 2},
        predicted_throughput_old=0.0,
        predicted_throughput_new=math.inf,
        expected_gain_s=math.inf,
        prediction_error=math.nan,
    )
    with Ledger(path) as ledger:
        ledger.append(record)
    assert b'"expected_gain_s":"inf"' in path.read_bytes()
    (loaded,) = Ledger.load(path)
    assert isinstance(loaded, DecisionRecord)
    assert loaded.expected_gain_s == math.inf and loaded.predicted_throughput_new == math.inf
    assert loaded.prediction_error is not None and math.isnan(loaded.prediction_error)
    assert loaded.reason == record.reason
    assert str(loaded.reason) == (
        "commit: saves all remaining work net of 1.000 s migration; bottleneck None"
    )


def test_scheduler_ledger_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    s, clock = make(path, max_failed_moves=1)
    commands: list[MigrationCommand] = []
    while not commands:
        commands = step(s, clock)
    finish(s, commands[0], ok=False)
    step(s, clock)
    s.ledger.close()
    loaded = Ledger.load(path)
    assert list(loaded) == list(s.ledger)
    assert {type(r).__name__ for r in loaded} == {
        "DecisionRecord",
        "ObservationRecord",
        "SafeModeRecord",
    }
    assert loaded.query(committed=False, kind="safety") == []
    # The first round ran on rollout's report alone: the trainer had not reported yet.
    assert len(loaded.query(kind="observation")) == len(loaded.query(kind="decision"))
    assert len(loaded.query(component="trainer", kind="observation")) == len(loaded) // 2 - 1
