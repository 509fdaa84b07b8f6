"""Realised effects of moves and the loss rule: every committed move is measured on the work
it knew of; a component whose moves lost time is held until its prediction error falls."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest
from sched_support import NODES, START, TRAINER, PowerLawPredictor, report

from dynarl.bus import ComponentReport, DecisionRecord, NoMovableDonor, Rejected
from dynarl.sched import (
    HyperNode,
    ManualClock,
    MigrationCommand,
    MoveOutcome,
    Scheduler,
    SchedulerConfig,
    StaticMigrationCost,
)
from dynarl.sched._effects import LossRule, Realised
from dynarl.types import MigrationKind


class Job:
    """A scheduler over a rollout tail and a trainer's backlog, fed scripted reports."""

    def __init__(self, nodes: dict[str, HyperNode] = NODES, **config: object) -> None:
        self.clock = ManualClock()
        self.predictor = PowerLawPredictor(
            {"rollout": (100.0, 0.9, 4.0), "trainer": (10.0, 1.0, 0.0)}
        )
        settings = {"num_devices_per_node": 4, "min_move_interval_s": 0.0} | config
        self.s = Scheduler(
            graph=nodes,
            allocation=START,
            predictor=self.predictor,
            cost=StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 1.0, MigrationKind.P2P: 2.0}),
            clock=self.clock,
            config=SchedulerConfig(**settings),  # type: ignore[arg-type]
        )
        self.iteration = 0
        self.done = {"rollout": 0, "trainer": 0}
        self.left = {"rollout": 8, "trainer": 1000}

    def step(self, **finished: int) -> list[MigrationCommand]:
        """One second: ``finished`` items complete per component, then both report."""
        t = self.clock.advance(1.0)
        for name, n in finished.items():
            n = min(n, self.left[name])
            self.done[name] += n
            self.left[name] -= n
        reports: list[ComponentReport] = []
        for name in ("rollout", "trainer"):
            devices = self.s.allocation.count(name)
            workers = devices if name == "rollout" else devices // 2
            r = report(
                name,
                kind=name,
                time=t,
                utilization=(0.05 if name == "rollout" else 1.0,) * workers,
                remaining=self.left[name],
                queue_depth=0 if name == "rollout" else min(self.left[name], 50),
                iteration=self.iteration,
            )
            reports.append(msgspec.structs.replace(r, completed=self.done[name]))
        commands = self.s.handle_many(reports)
        for command in commands:
            self.s.handle(
                MoveOutcome(
                    decision_id=command.decision_id, ok=True, allocation=command.new_allocation
                )
            )
        return commands

    def next_iteration(self) -> None:
        """The barrier: back to the start allocation, a new batch."""
        self.iteration += 1
        self.done = {"rollout": 0, "trainer": 0}
        self.left = {"rollout": 8, "trainer": 1000}
        self.s.handle(
            MoveOutcome(
                decision_id=f"barrier-{self.iteration}", ok=True, allocation=START, external=True
            )
        )

    def record(self, decision_id: str) -> DecisionRecord:
        record = self.s.ledger.get(decision_id)
        assert isinstance(record, DecisionRecord)
        return record


def test_every_committed_move_of_an_iteration_is_measured() -> None:
    # Rollout's tail goes to the trainer, then, done, rollout parks: two moves.
    parkable = replace(NODES["rollout"], parkable=True)
    job = Job({"rollout": parkable, "trainer": replace(TRAINER, dp_sizes=())})
    job.left["trainer"] = 10_000
    moves = [c for _ in range(4) for c in job.step(trainer=10)]
    moves += [c for _ in range(10) for c in job.step(rollout=4, trainer=10)]
    assert len(moves) == 2 and moves[1].new_allocation.count("rollout") == 0
    for _ in range(100):
        job.step(trainer=100)
    for command in moves:
        record = job.record(command.decision_id)
        assert record.prediction_error is not None, command.decision_id
        # Nothing was still to reach either component: the work known was the rest.
        assert record.realised_iteration_delta_s is not None, command.decision_id


def test_a_move_made_while_work_still_comes_gets_no_iteration_delta() -> None:
    nodes = {"rollout": NODES["rollout"], "trainer": replace(TRAINER, predecessors=("rollout",))}
    job = Job(nodes)
    (first, *_) = [c for _ in range(6) for c in job.step(trainer=10)]
    for _ in range(40):
        job.step(rollout=1, trainer=100)
    record = job.record(first.decision_id)
    assert record.prediction_error is not None
    assert record.realised_iteration_delta_s is None


def test_a_component_whose_moves_lose_is_held_until_its_prediction_error_falls() -> None:
    job = Job(num_error_samples=4, max_prediction_error=10.0)
    job.predictor.errors["rollout"] = (0.8, 8)
    (first,) = [c for _ in range(4) for c in job.step()]
    assert first.new_allocation.count("rollout") < 12
    # The tail the predictor thought nearly over drags on: rollout, shrunk, sets the pace,
    # while the trainer does its work faster than predicted.
    job.step(trainer=1000)
    for _ in range(60):
        job.step()
    job.step(rollout=8)
    record = job.record(first.decision_id)
    assert record.realised_iteration_delta_s is not None and record.realised_iteration_delta_s > 0
    assert set(job.s.losses.held) == {"rollout"}
    job.next_iteration()
    assert [c for _ in range(8) for c in job.step()] == []
    last = job.s.ledger.query(kind="decision")[-1]
    assert isinstance(last, DecisionRecord) and last.reason == Rejected(why=NoMovableDonor())
    # Released once its error is below half what it was when it was held.
    job.predictor.errors["rollout"] = (0.5, 8)
    assert job.step() == [] and "rollout" in job.s.losses.held
    job.predictor.errors["rollout"] = (0.3, 8)
    assert len(job.step()) == 1 and not job.s.losses.held


def _loss(iteration: int, delta: float, *, overran: tuple[str, ...] = ("a",)) -> Realised:
    return Realised(
        decision_id=f"d{iteration}",
        iteration=iteration,
        components=("a", "b"),
        overran=overran,
        realised_s=10.0,
        realised_iteration_delta_s=delta,
        prediction_error=0.5,
    )


@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_loss_rule_weighs_the_last_k_iterations_and_charges_what_overran(k: int) -> None:
    rule = LossRule(SchedulerConfig(num_loss_iterations=k, num_error_samples=1))
    errors = {"a": (0.4, 8), "b": (0.0, 8)}
    assert rule.record(_loss(0, -5.0), errors) == []
    # A 3 s loss against a 5 s gain one iteration earlier: a loss only when that gain
    # has left the window.
    newly = rule.record(_loss(1, 3.0), errors)
    assert newly == (["a"] if k == 1 else [])
    assert "b" not in rule.held
    if k == 1:
        assert rule.release({"a": (0.3, 8)}) == []
        assert rule.release({"a": (0.1, 8)}) == ["a"] and not rule.held
