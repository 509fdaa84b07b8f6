"""The scheduler coroutine in virtual time: rounds, gates, safe mode, observe-only, quota."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import msgspec
import pytest
from sched_support import NODES, ROLLOUT, START, TRAINER, PowerLawPredictor, report

from dynarl.bus import (
    ComponentReport,
    DecisionRecord,
    MigrationRecord,
    MinimumInterval,
    MoveInFlight,
    NoDonor,
    ObserveOnly,
    QuotaRefused,
    SafeMode,
)
from dynarl.sched import (
    Hypergraph,
    HyperNode,
    Ledger,
    ManualClock,
    MigrationCommand,
    MoveOutcome,
    OperatorCommand,
    Scheduler,
    SchedulerConfig,
    StaticMigrationCost,
    Tick,
    queued_batches,
)
from dynarl.sched._events import QuotaChange
from dynarl.sched._ledger_records import ObservationRecord
from dynarl.types import Allocation, ComponentKind, MigrationKind


def make(**config: object) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    settings = {"num_devices_per_node": 4, "min_move_interval_s": 10.0} | config
    scheduler = Scheduler(
        graph=NODES,
        allocation=START,
        predictor=PowerLawPredictor({"rollout": (100.0, 0.9, 4.0), "trainer": (10.0, 1.0, 0.0)}),
        cost=StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 1.0, MigrationKind.P2P: 2.0}),
        clock=clock,
        config=SchedulerConfig(**settings),  # type: ignore[arg-type]
    )
    return scheduler, clock


def interval(
    s: Scheduler, t: float, *, idle: bool = True, interruptible: bool = True
) -> list[ComponentReport]:
    n_roll = s.allocation.count("rollout")
    n_train = s.allocation.count("trainer")
    return [
        report(
            "rollout",
            time=t,
            utilization=((0.05 if idle else 0.9),) * n_roll,
            remaining=8 if idle else 4000,
            interruptible=interruptible,
        ),
        report(
            "trainer",
            kind="trainer",
            time=t,
            utilization=(1.0,) * (n_train // 2),
            remaining=1000,
            queue_depth=50,
        ),
    ]


def advance(s: Scheduler, clock: ManualClock, seconds: int, **kw: object) -> list[MigrationCommand]:
    commands: list[MigrationCommand] = []
    for _ in range(seconds):
        t = clock.advance(1.0)
        for r in interval(s, t, **kw):  # type: ignore[arg-type]
            commands += s.handle(r)
    return commands


def decisions(ledger: Ledger) -> list[DecisionRecord]:
    return [r for r in ledger.query(kind="decision") if isinstance(r, DecisionRecord)]


def observations(ledger: Ledger) -> list[ObservationRecord]:
    return [r for r in ledger.query(kind="observation") if isinstance(r, ObservationRecord)]


def finish(s: Scheduler, command: MigrationCommand, ok: bool = True) -> None:
    s.handle(
        MoveOutcome(
            decision_id=command.decision_id,
            ok=ok,
            allocation=command.new_allocation if ok else command.old_allocation,
            reason="" if ok else "peer lost",
        )
    )


def test_tail_donor_is_moved_after_t_seconds_and_every_round_is_recorded() -> None:
    s, clock = make()
    assert advance(s, clock, 3) == []  # idle for 3 s < T = 4 s
    rounds = decisions(s.ledger)
    assert len(rounds) == 3 and all(r.reason == NoDonor() for r in rounds)
    assert str(rounds[0].reason) == "hold: no donor"
    (command,) = advance(s, clock, 1)
    assert command.new_allocation.count("trainer") > 4
    assert command.old_allocation == START and not command.forced
    (last,) = s.ledger.query(committed=True)
    assert isinstance(last, DecisionRecord) and last.decision_id == command.decision_id
    assert last.donor == "rollout" and last.receivers == ("trainer",)
    assert last.expected_gain_s > 0 and last.predicted_bottleneck is not None
    # While the move is in flight nothing else moves.
    assert advance(s, clock, 2) == []
    assert decisions(s.ledger)[-1].reason == MoveInFlight(decision_id="d000004")


def test_minimum_interval_between_moves() -> None:
    s, clock = make(min_move_interval_s=5.0)
    (command,) = advance(s, clock, 4)
    finish(s, command)
    assert s.allocation == command.new_allocation
    # The trainer is still the bottleneck and the rollout tail still idle: a second move
    # is wanted but must wait out the interval (and the donor's idle clock restarts).
    commands = advance(s, clock, 4)
    assert commands == []
    assert any(isinstance(r.reason, MinimumInterval) for r in decisions(s.ledger))


def test_failed_moves_enter_safe_mode_until_cool_down() -> None:
    s, clock = make(min_move_interval_s=0.0, max_failed_moves=2, safe_mode_cooldown_s=20.0)
    (first,) = advance(s, clock, 4)
    finish(s, first, ok=False)
    assert s.allocation == START and not s.safety.safe
    (second,) = advance(s, clock, 1)
    finish(s, second, ok=False)
    assert s.safety.safe and "2 consecutive failed moves" in s.safety.safe_reason
    assert advance(s, clock, 10) == []
    assert decisions(s.ledger)[-1].reason == SafeMode(why="2 consecutive failed moves")
    assert s.allocation == START  # the last valid allocation is frozen
    commands = advance(s, clock, 11)
    assert not s.safety.safe and len(commands) == 1


def test_operator_safe_mode_outlasts_cool_down_and_observe_only_never_moves() -> None:
    s, clock = make(safe_mode_cooldown_s=1.0)
    s.handle(OperatorCommand(action="enter_safe_mode", reason="maintenance"))
    assert advance(s, clock, 8) == []
    assert s.safety.safe and s.safety.safe_reason == "maintenance"
    s.handle(OperatorCommand(action="leave_safe_mode"))
    s.handle(OperatorCommand(action="observe_only"))
    assert advance(s, clock, 3) == []
    would = [r for r in decisions(s.ledger) if isinstance(r.reason, ObserveOnly)]
    assert would and all(not r.committed and r.new_allocation == r.old_allocation for r in would)
    assert all(r.expected_gain_s > 0 for r in would)
    assert all(str(r.reason).startswith("observe-only, would commit: saves ") for r in would)
    s.handle(OperatorCommand(action="act"))
    assert len(advance(s, clock, 1)) == 1


def test_prediction_error_beyond_bound_enters_safe_mode() -> None:
    s, clock = make(num_error_samples=4, max_prediction_error=0.3)
    assert isinstance(s.predictor, PowerLawPredictor)
    s.predictor.errors["trainer"] = (0.9, 4)
    assert advance(s, clock, 5) == []
    assert s.safety.safe and "prediction error of trainer" in s.safety.safe_reason


def test_non_interruptible_components_are_not_planned() -> None:
    s, clock = make()
    assert advance(s, clock, 8, interruptible=False) == []
    assert all(not r.committed for r in decisions(s.ledger))


def test_quota_grant_replans_and_reclaim_forces_a_shrink() -> None:
    s, clock = make(max_quota_devices=24, min_quota_devices=8)
    advance(s, clock, 1, idle=False)
    clock.advance(1.0)
    (grant,) = s.handle(QuotaChange(granted=tuple(range(16, 24))))
    assert (
        grant.new_allocation.count("trainer") == 8 + 4 or grant.new_allocation.count("trainer") > 4
    )
    finish(s, grant)
    clock.advance(20.0)
    (reclaim,) = s.handle(QuotaChange(reclaimed=(0, 1, 2)))
    assert reclaim.forced
    assert reclaim.new_allocation.count("rollout") == s.allocation.count("rollout") - 3
    assert not set(reclaim.new_allocation.devices("rollout")) & {0, 1, 2}
    finish(s, reclaim)
    assert {0, 1, 2}.isdisjoint(s.free) and s.allocation == reclaim.new_allocation
    refused = s.handle(QuotaChange(granted=tuple(range(100, 120))))
    last = decisions(s.ledger)[-1]
    assert refused == [] and isinstance(last.reason, QuotaRefused) and "refused" in str(last.reason)


class Sink:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.commands: list[MigrationCommand] = []

    async def submit(self, command: MigrationCommand) -> None:
        await asyncio.sleep(self.delay)
        self.commands.append(command)


async def events(s: Scheduler, clock: ManualClock) -> AsyncIterator[ComponentReport | Tick]:
    for _ in range(5):
        t = clock.advance(1.0)
        for r in interval(s, t):
            yield r
    yield Tick()


def test_run_coroutine_submits_commands() -> None:
    s, clock = make(min_move_interval_s=0.0)
    sink = Sink(0.0)
    asyncio.run(s.run(events(s, clock), sink))
    (command,) = sink.commands
    assert s.safety.in_flight == command.decision_id


def test_run_coroutine_counts_a_timed_out_submission_as_a_failed_move() -> None:
    s, clock = make(min_move_interval_s=0.0)
    s.submit_timeout_s = 0.01
    asyncio.run(s.run(events(s, clock), Sink(1.0)))
    # Both rounds that committed (t=4 and t=5) timed out; nothing is left in flight.
    assert s.safety.failures == 2 and s.safety.in_flight is None
    assert s.allocation == START


def test_migration_records_reach_the_ledger() -> None:
    s, clock = make()
    (command,) = advance(s, clock, 4)
    record = MigrationRecord(
        migration_id="m1",
        decision_id=command.decision_id,
        time=clock.now(),
        kind="p2p",
        component="trainer",
        src_devices=(12, 13, 14, 15),
        dst_devices=command.new_allocation.devices("trainer"),
        outcome="committed",
    )
    s.handle(
        MoveOutcome(
            decision_id=command.decision_id,
            ok=True,
            allocation=command.new_allocation,
            records=(record,),
        )
    )
    assert s.ledger.query(kind="migration", component="trainer") == [record]


def test_graph_registry_backed_scheduler_and_bad_reports_are_dropped() -> None:
    clock = ManualClock()
    graph = Hypergraph.of(NODES.values())
    s = Scheduler(
        graph=graph,
        allocation=START,
        predictor=PowerLawPredictor({"rollout": (100.0, 0.9, 4.0), "trainer": (10.0, 1.0, 0.0)}),
        cost=StaticMigrationCost(seconds={MigrationKind.P2P: 2.0}),
        clock=clock,
        config=SchedulerConfig(num_devices_per_node=4),
        free=(16, 17),
    )
    assert s.free == (16, 17)
    s.handle(report("critic", time=1.0))  # unknown component: dropped, nothing breaks
    clock.advance(2.0)
    s.handle(report("rollout", time=2.0))
    s.handle(report("rollout", time=1.5))  # older than the latest: dropped
    assert s.windows.stats()["rollout"].time == 2.0
    with pytest.raises(ValueError, match="not in the graph"):
        Scheduler(
            graph=graph,
            allocation=Allocation.of({"ghost": [0]}),
            predictor=PowerLawPredictor({}),
            cost=StaticMigrationCost(seconds={}),
            clock=clock,
        )


def test_an_external_move_sets_the_allocation_and_restarts_the_interval() -> None:
    s, clock = make()
    (command,) = advance(s, clock, 6)
    # The pipeline moves devices on its own while the scheduler's move is in flight:
    # its word on the allocation holds, the move in flight does not end.
    barrier = Allocation.of({"rollout": range(0, 14), "trainer": (14, 15)})
    s.handle(MoveOutcome(decision_id="barrier-0", ok=True, allocation=barrier, external=True))
    assert s.allocation == barrier and s.safety.in_flight == command.decision_id
    finish(s, command)
    assert s.safety.in_flight is None
    clock.advance(20.0)
    s.handle(MoveOutcome(decision_id="barrier-1", ok=True, allocation=START, external=True))
    assert s.allocation == START and s.safety.in_flight is None
    # No move within the minimum interval after the external one.
    assert advance(s, clock, 9) == []
    assert isinstance(decisions(s.ledger)[-1].reason, MinimumInterval)


def fresh_pair(s: Scheduler, t: float) -> list[ComponentReport]:
    """An instant's reports, the trainer's backlog different from any earlier one."""
    rollout, trainer = interval(s, t)
    return [rollout, msgspec.structs.replace(trainer, remaining=777, queue_depth=33)]


def test_a_batch_runs_one_round_that_sees_every_report_of_it() -> None:
    s, clock = make()
    advance(s, clock, 1)
    batch = fresh_pair(s, clock.advance(1.0))
    assert s.handle_many(batch) == []
    assert len(decisions(s.ledger)) == 2  # one round per batch
    seen = observations(s.ledger)[-1].components
    assert (seen["trainer"].remaining, seen["trainer"].queue_depth) == (777, 33)
    assert seen["rollout"].remaining == 8


def test_one_event_at_a_time_rounds_on_the_first_report_of_an_instant() -> None:
    s, clock = make()
    advance(s, clock, 1)
    rollout, trainer = fresh_pair(s, clock.advance(1.0))
    s.handle(rollout)
    s.handle(trainer)  # within the decision interval: no second round
    assert len(decisions(s.ledger)) == 2
    seen = observations(s.ledger)[-1].components
    assert (seen["trainer"].remaining, seen["trainer"].queue_depth) == (1000, 50)


def test_a_batch_without_reports_runs_no_round() -> None:
    s, clock = make()
    clock.advance(5.0)
    assert s.handle_many([OperatorCommand(action="observe_only")]) == []
    assert decisions(s.ledger) == [] and s.observe_only
    s.handle_many([])
    assert decisions(s.ledger) == []


def test_a_batch_with_a_move_outcome_rounds_after_it() -> None:
    s, clock = make(min_move_interval_s=0.0)
    (command,) = advance(s, clock, 4)
    t = clock.advance(1.0)
    done = MoveOutcome(decision_id=command.decision_id, ok=True, allocation=command.new_allocation)
    # The reports first, the outcome last: the one round runs with no move in flight.
    s.handle_many([*interval(s, t), done])
    assert s.safety.in_flight != command.decision_id
    assert not isinstance(decisions(s.ledger)[-1].reason, MoveInFlight)


def test_queued_batches_drain_what_is_queued_and_stop_at_none() -> None:
    async def main() -> list[list[object]]:
        queue: asyncio.Queue[object] = asyncio.Queue()
        for item in (Tick(), OperatorCommand(action="act"), Tick()):
            queue.put_nowait(item)
        out: list[list[object]] = []
        async for batch in queued_batches(queue):  # type: ignore[arg-type]
            out.append(list(batch))
            if len(out) == 1:
                queue.put_nowait(Tick())
                queue.put_nowait(None)
                queue.put_nowait(Tick())  # after the end: never read
        return out

    first, second = asyncio.run(main())
    assert first == [Tick(), OperatorCommand(action="act"), Tick()]
    assert second == [Tick()]


def test_run_takes_batches_and_single_events() -> None:
    s, clock = make(min_move_interval_s=0.0)

    async def stream() -> AsyncIterator[ComponentReport | list[ComponentReport]]:
        for _ in range(3):
            yield interval(s, clock.advance(1.0))
        for r in interval(s, clock.advance(1.0)):
            yield r

    sink = Sink(0.0)
    asyncio.run(s.run(stream(), sink))
    # 3 batches (one round each) and one round on the last instant's first report.
    assert len(decisions(s.ledger)) == 4 and len(sink.commands) == 1


def test_a_finished_donor_is_moved_within_the_minimum_interval() -> None:
    # A parkable rollout done with its iteration (nothing left, no predecessor) idles until
    # the next one: the interval between moves does not hold its devices back, once a
    # report made after the last move says it is done.
    clock = ManualClock()
    s = Scheduler(
        graph={"rollout": replace(ROLLOUT, parkable=True), "trainer": TRAINER},
        allocation=START,
        predictor=PowerLawPredictor({"rollout": (100.0, 0.9, 4.0), "trainer": (10.0, 1.0, 0.0)}),
        cost=StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 1.0, MigrationKind.P2P: 2.0}),
        clock=clock,
        config=SchedulerConfig(num_devices_per_node=4, min_move_interval_s=60.0),
    )

    def step(remaining: int) -> list[MigrationCommand]:
        t = clock.advance(1.0)
        rollout, trainer = interval(s, t)
        return s.handle_many([msgspec.structs.replace(rollout, remaining=remaining), trainer])

    commands = [c for _ in range(4) for c in step(8)]
    (first,) = commands
    assert 0 < first.new_allocation.count("rollout") < 12
    assert step(0) == []  # the move is in flight
    clock.advance(1.0)
    finish(s, first)  # its round sees only a report from before the move's end
    assert s.safety.last_move_end == clock.now()
    assert isinstance(decisions(s.ledger)[-1].reason, MinimumInterval)
    later = [(clock.now(), c) for _ in range(10) for c in step(0)]
    assert len(later) == 1
    when, second = later[0]
    assert when - s.safety.last_move_end < 60.0
    assert second.new_allocation.count("rollout") == 0
    assert second.new_allocation.count("trainer") == 16


@pytest.mark.parametrize("gate", ["safe mode", "minimum interval", "operator"])
def test_a_starved_component_gets_a_device_through_safe_mode_but_not_an_operators_hold(
    gate: str,
) -> None:
    """A scorer with work and no device cannot finish; safe mode the scheduler entered
    itself still gives it one (found on real SGLang: it waited out a 300 s cool-down);
    an operator's hold does not, nor does the minimum interval (seconds: it waits)."""
    clock = ManualClock()
    scorer = HyperNode(name="scorer", kind=ComponentKind.INFERENCE, min_devices=0)
    rollout = HyperNode(name="rollout", kind=ComponentKind.ROLLOUT, min_devices=1)
    predictor = PowerLawPredictor({"rollout": (10.0, 1.0, 8.0), "scorer": (5.0, 1.0, 0.0)})
    s = Scheduler(
        graph={"rollout": rollout, "scorer": scorer},
        allocation=Allocation.of({"rollout": [0, 1], "scorer": []}),
        predictor=predictor,
        cost=StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 1.0}),
        clock=clock,
        config=SchedulerConfig(
            min_move_interval_s=1000.0 if gate == "minimum interval" else 0.0,
            num_error_samples=4,
        ),
    )
    if gate == "safe mode":
        predictor.errors["rollout"] = (0.9, 4)
    elif gate == "operator":
        s.handle(OperatorCommand(action="enter_safe_mode", reason="maintenance"))
    else:  # a move the pipeline made itself, just now
        s.handle(MoveOutcome(decision_id="op1", ok=True, allocation=s.allocation, external=True))
    commands: list[MigrationCommand] = []
    for _ in range(6):
        t = clock.advance(1.0)
        commands += s.handle(report("rollout", time=t, utilization=(0.05, 0.05), remaining=3))
        commands += s.handle(
            report("scorer", kind="inference", time=t, utilization=(), remaining=5, queue_depth=5)
        )
        if commands:
            break
    if gate != "safe mode":
        assert commands == []
        assert isinstance(decisions(s.ledger)[-1].reason, SafeMode | MinimumInterval)
        return
    assert s.safety.safe
    (command,) = commands
    assert command.new_allocation.count("scorer") >= 1
    assert command.new_allocation.count("rollout") >= 1
