"""The runtime's migration drivers over fake group managers, in virtual time.

The coordinator runs its real drivers (:class:`WorkloadMove`, :class:`P2PMove`,
:class:`RebootMove`) on a :class:`~dynarl.sched.ManualClock`: a move commits or rolls back
whole; a stalled step outlives an hour-long lease and a dropped P2P message waits out a
half-hour step timeout, both instantly (the clock jumps; nothing sleeps for real, so the
per-test timeout would stop a test that did); a rank's own lease watchdog does the same.
The last two check that ``dynarl/runtime`` sequences no migration step: while moves of
every kind commit and roll back, the only methods of a ``dynarl.migrate`` machine called
from a runtime module are ``run_to_commit``, ``commit`` and ``cancel``; and no runtime
module imports the step vocabulary that running a step by name would need.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import dynarl.runtime
from dynarl.bus import MigrationRecord
from dynarl.migrate import (
    Layout,
    P2PGroupMigration,
    ParamSpec,
    PartialRequest,
    RebootMigration,
    Stage,
    WorkloadMigration,
    replicated_layout,
)
from dynarl.runtime import ComponentSpec, RuntimeConfig
from dynarl.runtime._faults import Fault, FaultAction, FaultInjector
from dynarl.runtime._worker_protocol import Reshard, StepResult
from dynarl.runtime.controller._coordinator import Coordinator
from dynarl.runtime.controller._planner_cost import PlannerCost
from dynarl.runtime.worker._rank_migrations import RankMigrations
from dynarl.sched import DeviceMove, ManualClock, MigrationCommand, MoveOutcome
from dynarl.testing import ScriptedRollout, ShadowTrainer, TinyTrainer
from dynarl.types import Allocation, MigrationKind

HOUR = 3600.0


class FakeDispatcher:
    """The serving path: records every call, holds the requests of drained workers."""

    def __init__(self, log: list[str], workers: Sequence[int]) -> None:
        self.log, self.workers = log, set(workers)
        self.parked: list[str] = []

    async def stop_routing(self, workers: Sequence[int]) -> None:
        self.log.append(f"stop_routing {list(workers)}")
        self.workers -= set(workers)

    async def abort_inflight(self, workers: Sequence[int]) -> Sequence[PartialRequest]:
        self.log.append(f"abort_inflight {list(workers)}")
        return [PartialRequest(request_id=f"q{w}", prompt=(1,)) for w in workers]

    async def redispatch(self, requests: Sequence[PartialRequest], workers: Sequence[int]) -> None:
        self.log.append(f"redispatch {[r.request_id for r in requests]}")
        if not self.workers:
            self.parked += [r.request_id for r in requests]

    async def release(self, workers: Sequence[int]) -> None:
        self.log.append(f"release {list(workers)}")

    async def resume(self, workers: Sequence[int]) -> None:
        self.log.append(f"resume {list(workers)}")
        self.workers |= set(workers)

    def add_worker(self, device: int) -> None:
        self.log.append(f"add_worker {device}")
        self.workers.add(device)
        self.parked = []


class FakeRoles:
    """A reboot host that records its calls."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def save(self) -> str:
        self.log.append("save")
        return "ckpt"

    async def stop(self) -> None:
        self.log.append("stop")

    async def start(self, resources: Sequence[int]) -> None:
        self.log.append(f"start {list(resources)}")

    async def load(self, checkpoint: str) -> None:
        self.log.append(f"load {checkpoint}")


class FakeManager:
    """What the drivers use of a group manager."""

    def __init__(self, spec: ComponentSpec, log: list[str], request_timeout_s: float) -> None:
        self.lock = asyncio.Lock()
        self.log = log
        self.devices = tuple(spec.devices)
        self.request_timeout_s = request_timeout_s
        self.dispatcher = FakeDispatcher(log, spec.devices) if spec.serving else None
        self.leases: list[float] = []

    def set_devices(self, devices: Sequence[int]) -> None:
        self.devices = tuple(devices)

    async def activate(self, devices: Sequence[int], *, epoch: int = 0) -> None:
        self.log.append(f"activate {list(devices)}")

    async def release(self, devices: Sequence[int]) -> None:
        self.log.append(f"release {list(devices)}")

    def reboot_host(self, migration_id: str, *, epochs: Any, in_place: bool) -> FakeRoles:
        return FakeRoles(self.log)

    async def reshard(self, step: str, **kw: Any) -> list[StepResult]:
        ranks = sorted(set(kw["src"]) | set(kw["dst"]))
        if kw["only"] is not None:
            ranks = [r for r in ranks if r in kw["only"]]
        self.log.append(f"{step} {ranks}")
        self.leases.append(kw["lease_s"])
        return [StepResult(device=r, ok=True, bytes_moved=10) for r in ranks]


SPECS = [
    ComponentSpec(role=ScriptedRollout, devices=(0, 1)),
    ComponentSpec(role=TinyTrainer, devices=(2,)),
    ComponentSpec(role=ShadowTrainer, devices=(3,), migration=MigrationKind.REBOOT),
]
OLD = Allocation.of({"rollout": [0, 1], "trainer": [2], "shadow": [3]})


class Setup:
    def __init__(self, *faults: Fault, request_timeout_s: float = 60.0) -> None:
        self.clock = ManualClock()
        self.logs: dict[str, list[str]] = {spec.name: [] for spec in SPECS}
        self.managers = {
            spec.name: FakeManager(spec, self.logs[spec.name], request_timeout_s) for spec in SPECS
        }
        self.faults = FaultInjector(faults)
        self.published: list[MigrationRecord] = []
        self.coordinator = Coordinator(
            managers=self.managers,  # type: ignore[arg-type]
            specs={spec.name: spec for spec in SPECS},
            allocation=OLD,
            config=RuntimeConfig(lease_s=HOUR, request_timeout_s=request_timeout_s),
            faults=self.faults,
            clock=self.clock,
            cost=PlannerCost({}),
            outcomes=lambda outcome: None,
            publish=self.published.append,
        )

    def move(self, new: dict[str, list[int]], decision_id: str = "d1") -> MoveOutcome:
        old = self.coordinator.allocation
        command = MigrationCommand(
            decision_id=decision_id,
            time=self.clock.now(),
            old_allocation=old,
            new_allocation=Allocation.of(new),
            moves=(DeviceMove(src="rollout", dst="trainer", devices=(1,)),),
        )
        return asyncio.run(self.coordinator.execute(command))


def records(outcome: MoveOutcome) -> list[tuple[str, str, str]]:
    return [(r.component, r.kind, r.outcome) for r in outcome.records]


def test_a_workload_shrink_and_a_p2p_grow_commit_together() -> None:
    setup = Setup()
    outcome = setup.move({"rollout": [0], "trainer": [1, 2], "shadow": [3]})
    assert outcome.ok, outcome.reason
    assert records(outcome) == [
        ("rollout", "workload", "committed"),
        ("trainer", "p2p", "committed"),
    ]
    assert setup.logs["rollout"] == [
        "stop_routing [1]",
        "abort_inflight [1]",
        "redispatch ['q1']",
        "release [1]",
    ]
    assert setup.logs["trainer"] == [
        f"{step} [1, 2]" for step in ("prepare", "transfer", "verify", "commit", "close")
    ]
    assert setup.managers["trainer"].devices == (1, 2)
    assert setup.managers["rollout"].devices == (0,)
    assert outcome.records[1].bytes_moved == 5 * 2 * 10


def test_a_serving_component_parks_at_zero_and_grows_back() -> None:
    setup = Setup()
    away = setup.move({"rollout": [], "trainer": [0, 1, 2], "shadow": [3]})
    assert away.ok, away.reason
    dispatcher = setup.managers["rollout"].dispatcher
    assert dispatcher is not None and dispatcher.parked == ["q0", "q1"]
    back = setup.move({"rollout": [0, 1], "trainer": [2], "shadow": [3]}, "d2")
    assert back.ok, back.reason
    assert setup.logs["rollout"][-3:] == ["activate [0, 1]", "add_worker 0", "add_worker 1"]
    assert dispatcher.parked == []


def test_a_stateful_component_sleeps_at_zero_and_wakes_where_it_slept() -> None:
    setup = Setup()
    away = setup.move({"rollout": [0, 1, 3], "trainer": [2], "shadow": []})
    assert away.ok, away.reason
    assert setup.logs["shadow"] == ["save", "stop"]  # asleep in place: nothing restarted
    back = setup.move({"rollout": [0, 1], "trainer": [2], "shadow": [3]}, "d2")
    assert back.ok, back.reason
    assert setup.logs["shadow"][2:] == ["start [3]"]  # nothing to save, stop or load


def test_a_lease_lapses_in_virtual_time() -> None:
    setup = Setup(Fault(phase="reboot.load", action=FaultAction.STALL))
    outcome = setup.move({"rollout": [0], "trainer": [2], "shadow": [1, 3]})
    assert not outcome.ok and "load failed: lease expired" in outcome.reason
    assert records(outcome) == [  # in reverse
        ("shadow", "reboot", "rolled_back"),
        ("rollout", "workload", "rolled_back"),
    ]
    assert setup.clock.now() > HOUR  # the hour passed on the clock, not on the wall
    assert setup.logs["shadow"] == [
        "save",
        "stop",
        "start [1, 3]",
        "stop",
        "start [3]",
        "load ckpt",
    ]


def test_a_dropped_message_times_out_in_virtual_time() -> None:
    timeout_s = HOUR / 2
    setup = Setup(
        Fault(phase="p2p.transfer", action=FaultAction.DROP, device=1),
        request_timeout_s=timeout_s,
    )
    outcome = setup.move({"rollout": [0], "trainer": [1, 2], "shadow": [3]})
    assert not outcome.ok
    assert "transfer failed: rank 1: no reply to transfer (dropped)" in outcome.reason
    assert timeout_s <= setup.clock.now() < HOUR  # waited out the step timeout, not the lease
    assert setup.logs["trainer"][:2] == ["prepare [1, 2]", "transfer [2]"]
    assert setup.logs["trainer"][2:] == ["abort [1, 2]", "rollback [1, 2]", "close [1, 2]"]
    assert setup.managers["trainer"].devices == (2,)


class LoneRank:
    """A trainer role on a rank that holds the old layout only (device 0)."""

    def __init__(self) -> None:
        self.discarded = 0

    def layout(self, devices: tuple[int, ...]) -> Layout:
        return replicated_layout([ParamSpec(name="w", shape=(4,), stage=Stage.FIRST)], devices)

    def shard_views(self) -> dict[Any, Any]:
        return {}

    def allocate(self, layout: Layout, groups: Any) -> dict[Any, Any]:
        return {}

    def commit(self, layout: Layout) -> None:
        raise AssertionError("never committed")

    def discard(self, layout: Layout) -> None:
        self.discarded += 1


class Inline:
    """The compute thread, inline."""

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


class Hosting:
    def __init__(self, role: LoneRank) -> None:
        self._role = role

    def hosts(self, component: str) -> bool:
        return True

    def role(self, component: str) -> LoneRank:
        return self._role


def test_a_ranks_lease_watchdog_rolls_back_in_virtual_time() -> None:
    clock, role = ManualClock(), LoneRank()

    async def main() -> str:
        async with asyncio.TaskGroup() as group:
            ranks = RankMigrations(
                device=0,
                host=Hosting(role),  # type: ignore[arg-type]
                compute=Inline(),  # type: ignore[arg-type]
                store=lambda: None,  # type: ignore[arg-type,return-value]
                group=group,
                clock=clock,
            )
            prepare = Reshard(
                migration_id="m", step="prepare", component="trainer", src=(0,), dst=(1,),
                lease_s=HOUR,
            )  # fmt: skip
            result = await ranks.step(prepare)  # no store: prepare fails, nothing follows
            assert not result.ok
            entry = ranks._entries["m"]
            assert entry.watchdog is not None
            await entry.watchdog  # sleeps out the lease on the clock, then rolls back
            return entry.migration.state.phase

    assert asyncio.run(main()) == "rolled_back"
    assert role.discarded == 1 and clock.now() > HOUR


# ---------------------------------------------------------------- layering

DRIVER_API = {"run_to_commit", "commit", "cancel"}
"""All the runtime may call on a migrate machine: no step by name."""
SEQUENCING = {"Step", "StepRunner", "run_step", "new_migration", "begin", "finish"}
"""What a runtime module would need to run steps of its own."""


def test_the_runtime_calls_only_the_machines_driver_api(monkeypatch: pytest.MonkeyPatch) -> None:
    called: set[str] = set()

    def spy(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_globals["__name__"].startswith("dynarl.runtime"):
                called.add(name)
            return method(*args, **kwargs)

        return wrapper

    for cls in (WorkloadMigration, P2PGroupMigration, RebootMigration):
        for name in dir(cls):
            if not name.startswith("_") and inspect.iscoroutinefunction(getattr(cls, name)):
                monkeypatch.setattr(cls, name, spy(name, getattr(cls, name)))
    setup = Setup(Fault(phase="reboot.restart"))
    assert setup.move({"rollout": [0], "trainer": [1, 2], "shadow": [3]}).ok
    assert not setup.move({"rollout": [0], "trainer": [2], "shadow": [1, 3]}, "d2").ok
    assert called == DRIVER_API


def test_no_runtime_module_imports_what_runs_a_step() -> None:
    # durable/ reads KIND_STEPS to tell a journalled migration's forward steps apart:
    # reading the sequence, not running it.
    offences = []
    for path in Path(dynarl.runtime.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "dynarl.migrate"
            ):
                offences += [f"{path}: {a.name}" for a in node.names if a.name in SEQUENCING]
    assert offences == []
