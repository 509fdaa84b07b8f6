"""The coordinator's protocol over its drivers: all commit, or all roll back in reverse."""

from __future__ import annotations

import asyncio
from typing import Any

from dynarl.bus import MigrationRecord
from dynarl.migrate import Outcome, Step
from dynarl.runtime import ComponentSpec, RuntimeConfig
from dynarl.runtime._faults import FaultInjector
from dynarl.runtime.controller._coordinator import Coordinator
from dynarl.runtime.controller._moves import ComponentMove
from dynarl.runtime.controller._planner_cost import PlannerCost
from dynarl.sched import DeviceMove, ManualClock, MigrationCommand, MoveOutcome
from dynarl.testing import ScriptedRollout, TinyTrainer
from dynarl.types import Allocation

OLD = Allocation.of({"rollout": [0, 1], "trainer": [2]})
NEW = Allocation.of({"rollout": [0], "trainer": [1, 2]})


class FakeDriver:
    def __init__(
        self,
        move: ComponentMove,
        log: list[tuple[str, str]],
        plan: dict[str, Any],
        clock: ManualClock,
    ) -> None:
        self.move, self.log = move, log
        self.migration_id = f"m-{move.component}"
        self.fail = plan.get(f"fail:{move.component}", False)
        self.deadline = clock.now() + plan.get("lease_left", 60.0)  # on the coordinator's clock
        self.pause_s, self.bytes_moved = 0.25, 100

        self.done: list[Outcome] = []

    @property
    def state(self) -> Any:
        return self

    def _outcome(self, step: Step, ok: bool = True) -> Outcome:
        outcome = Outcome(
            migration_id=self.migration_id, step=step, ok=ok, detail="" if ok else "boom"
        )
        self.done.append(outcome)
        return outcome

    async def pre_commit(self) -> Outcome | None:
        self.log.append(("prepare", self.move.component))
        outcome = self._outcome(Step.PREPARE, ok=not self.fail)
        return None if outcome.ok else outcome

    async def commit(self) -> Outcome:
        self.log.append(("commit", self.move.component))
        return self._outcome(Step.COMMIT)

    async def cancel(self, reason: str) -> Outcome:
        self.log.append(("rollback", self.move.component))
        return self._outcome(Step.ROLLBACK)


class Manager:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()


class Journal:
    """Records what the coordinator journals (the allocation journal's protocol)."""

    def __init__(self) -> None:
        self.entries: list[tuple[object, ...]] = []

    def commit(self, allocation: Allocation, *, migration_id: str = "") -> int:
        self.entries.append(("commit", migration_id, allocation))
        return len(self.entries)

    def begin_migration(self, *, migration_id: str, target: Allocation, **kw: object) -> None:
        self.entries.append(("begin", migration_id, target, kw["component"], tuple(kw["devices"])))  # type: ignore[arg-type]

    def record_step(self, migration_id: str, step: str, *, ok: bool, detail: str = "") -> None:
        self.entries.append(("step", step, ok))

    def end_migration(self, migration_id: str, outcome: str, reason: str = "") -> None:
        self.entries.append(("end", migration_id, outcome))


def run(
    plan: dict[str, Any], commands: list[MigrationCommand]
) -> tuple[list[MoveOutcome], list[tuple[str, str]], Journal, Coordinator]:
    log: list[tuple[str, str]] = []
    journal = Journal()
    specs = [
        ComponentSpec(role=ScriptedRollout, devices=(0, 1)),
        ComponentSpec(role=TinyTrainer, devices=(2,)),
    ]

    clock = ManualClock()

    class Fake(Coordinator):
        def _driver(self, decision_id: str, move: ComponentMove, lease_s: float) -> Any:
            return FakeDriver(move, log, plan, clock)

    published: list[MigrationRecord] = []
    coordinator = Fake(
        managers={"rollout": Manager(), "trainer": Manager()},  # type: ignore[dict-item]
        specs={spec.name: spec for spec in specs},
        allocation=OLD,
        config=RuntimeConfig(),
        faults=FaultInjector(),
        clock=clock,
        cost=PlannerCost({}),
        outcomes=lambda outcome: None,
        publish=published.append,
        journal=journal,
    )

    async def main() -> list[MoveOutcome]:
        return [await coordinator.execute(command) for command in commands]

    return asyncio.run(main()), log, journal, coordinator


def move(decision_id: str = "d1", old: Allocation = OLD) -> MigrationCommand:
    return MigrationCommand(
        decision_id=decision_id,
        time=0.0,
        old_allocation=old,
        new_allocation=NEW,
        moves=(DeviceMove(src="rollout", dst="trainer", devices=(1,)),),
    )


def test_every_migration_commits_after_every_one_prepared() -> None:
    (outcome, again), log, journal, coordinator = run({}, [move(), move()])
    assert log == [
        ("prepare", "rollout"),
        ("prepare", "trainer"),
        ("commit", "rollout"),
        ("commit", "trainer"),
    ]
    assert outcome.ok and outcome.allocation == NEW and coordinator.allocation == NEW
    assert again is outcome  # the same decision is answered from its record
    assert journal.entries == [
        ("begin", "d1", NEW, "trainer", (1,)),
        ("step", "prepare", True),
        ("step", "prepare", True),
        ("commit", "d1", NEW),
    ]
    assert [(r.component, r.outcome, r.pause_s) for r in outcome.records] == [
        ("rollout", "committed", 0.25),
        ("trainer", "committed", 0.25),
    ]


def test_a_failure_rolls_every_started_migration_back_in_reverse() -> None:
    (outcome,), log, journal, coordinator = run({"fail:trainer": True}, [move()])
    assert log == [
        ("prepare", "rollout"),
        ("prepare", "trainer"),
        ("rollback", "trainer"),
        ("rollback", "rollout"),
    ]
    assert not outcome.ok and "boom" in outcome.reason
    assert outcome.allocation == OLD and coordinator.allocation == OLD
    assert journal.entries[-4:] == [
        ("step", "prepare", False),
        ("step", "rollback", True),
        ("step", "rollback", True),
        ("end", "d1", "rolled_back"),
    ]
    assert {r.outcome for r in outcome.records} == {"rolled_back"}


def test_a_lease_about_to_lapse_and_a_stale_command_are_refused() -> None:
    (outcome,), log, _, _ = run({"lease_left": 0.5}, [move()])
    assert not outcome.ok and outcome.reason == "lease lapsed before commit"
    assert ("commit", "rollout") not in log and ("rollback", "rollout") in log
    stale = Allocation.of({"rollout": [0], "trainer": [1, 2]})
    (outcome,), log, _, _ = run({}, [move(old=stale)])
    assert not outcome.ok and outcome.reason.startswith("stale") and log == []
