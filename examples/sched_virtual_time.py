"""Drive dynarl's scheduler in virtual time through a rollout tail.

Sixteen devices: rollout starts with twelve and the trainer with four. As rollout queries
run out, its engines idle below U_low; after T seconds Stage 1 flags rollout as a donor
and Stage 2 moves devices to the trainer. Nothing sleeps: a ManualClock is the time.

Run: .venv/bin/python examples/sched_virtual_time.py
"""

from __future__ import annotations

from dynarl.bus import ComponentReport, DecisionRecord
from dynarl.sched import (
    ComponentProfile,
    HyperNode,
    ManualClock,
    MoveOutcome,
    ProfilePoint,
    RegressionPredictor,
    Scheduler,
    SchedulerConfig,
    StaticMigrationCost,
)
from dynarl.types import Allocation, ComponentKind, MigrationKind


def main() -> None:
    nodes = {
        "rollout": HyperNode(name="rollout", kind=ComponentKind.ROLLOUT, min_devices=2),
        "trainer": HyperNode(
            name="trainer", kind=ComponentKind.TRAINER, migration=MigrationKind.P2P, tp=2
        ),
    }
    profiles = {
        "rollout": ComponentProfile(
            points=tuple(ProfilePoint(num_devices=n, throughput=20.0 * n**0.9) for n in (1, 4, 16)),
            items_per_device=4.0,
        ),
        "trainer": ComponentProfile(
            points=tuple(ProfilePoint(num_devices=n, throughput=2.0 * n) for n in (2, 8, 16))
        ),
    }
    clock = ManualClock()
    scheduler = Scheduler(
        graph=nodes,
        allocation=Allocation.of({"rollout": range(12), "trainer": range(12, 16)}),
        predictor=RegressionPredictor(profiles),
        cost=StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 4.0, MigrationKind.P2P: 1.0}),
        clock=clock,
        config=SchedulerConfig(num_devices_per_node=8),
    )
    remaining = 400
    for _ in range(12):
        t = clock.advance(1.0)
        remaining = max(remaining - 60, 6)
        busy = min(1.0, remaining / (4 * scheduler.allocation.count("rollout")))
        rollout = ComponentReport(
            component="rollout",
            kind="rollout",
            time=t,
            interval_s=1.0,
            utilization=(busy,) * scheduler.allocation.count("rollout"),
            remaining=remaining,
            queue_depth=0,
        )
        trainer = ComponentReport(
            component="trainer",
            kind="trainer",
            time=t,
            interval_s=1.0,
            utilization=(1.0,) * scheduler.allocation.count("trainer"),
            remaining=2000,
            queue_depth=64,
        )
        for report in (rollout, trainer):
            for command in scheduler.handle(report):
                print(
                    f"t={t:4.0f}s move: {scheduler.allocation.counts()} -> "
                    f"{command.new_allocation.counts()}"
                )
                scheduler.handle(
                    MoveOutcome(
                        decision_id=command.decision_id, ok=True, allocation=command.new_allocation
                    )
                )
    for record in scheduler.ledger.query(kind="decision"):
        assert isinstance(record, DecisionRecord)
        print(f"t={record.time:4.0f}s {record.decision_id}: {record.reason}")


if __name__ == "__main__":
    main()
