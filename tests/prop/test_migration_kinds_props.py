"""Every migration kind against a model of its component: arbitrary outcomes and faults.

One rule-based machine drives the ``dynarl.migrate`` machine of a kind (workload, P2P,
reboot) between an old and a new allocation drawn at random — a component that shrinks
to no device or grows from none included, where the kind allows it — over a fake
component. Rules, in any order: the coordinator's calls (``interrupt``, ``run_to_commit``,
``commit``, ``cancel``, ``migrate``, each of them possibly repeated), a failure of the
component's next call of some name (an exception before any side effect), a rank that
fails a P2P step, a fault at the start of a step (a failure, or a stall past the lease),
and a jump of the clock. The machine owns its event loop and drives each rule to
completion; the clock is a :class:`~dynarl.sched.ManualClock`.

Invariants (the documented outcome: the old allocation or the new, never both, never
neither): nothing is ever lost or duplicated (requests of a serving component, the
trainer's state on its ranks, a rebooted component's state); once committed the component
holds exactly the new allocation, once rolled back exactly the old one; and every run
ends in one of the two (the teardown cancels a migration that did not commit). A
rollback's own I/O does not fail here: a failed rollback is reported by the coordinator,
not undone, and is outside these invariants.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dynarl.migrate import (
    KIND_STEPS,
    Migration,
    P2PGroupMigration,
    PartialRequest,
    RebootMigration,
    Step,
    WorkloadMigration,
)
from dynarl.sched import ManualClock
from dynarl.types import MigrationKind

LEASE_S = 100.0
DEVICES = range(4)
STATE = "trained-weights"


class Armed:
    """One-shot failures of named calls (an exception before any side effect)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def call(self, name: str) -> None:
        if name in self.names:
            self.names.discard(name)
            raise RuntimeError(f"{name} failed")


class FakeServing:
    """A serving component: workers with their in-flight requests, a parking lot."""

    calls = ("activate", "stop_routing", "abort_inflight", "redispatch", "release", "admit")

    def __init__(self, src: Sequence[int], requests: Sequence[str]) -> None:
        self.armed = Armed()
        self.active, self.routed = set(src), set(src)
        self.queues: dict[int, list[str]] = {w: [] for w in src}
        self.parked: list[str] = []
        self._place(list(requests))

    def _place(self, ids: list[str]) -> None:
        targets = sorted(self.routed)
        if not targets:
            self.parked.extend(ids)
            return
        for n, request_id in enumerate(ids):
            self.queues[targets[n % len(targets)]].append(request_id)

    async def stop_routing(self, workers: Sequence[int]) -> None:
        self.armed.call("stop_routing")
        self.routed -= set(workers)

    async def abort_inflight(self, workers: Sequence[int]) -> Sequence[PartialRequest]:
        self.armed.call("abort_inflight")
        out = [PartialRequest(request_id=i, prompt=(1,)) for w in workers for i in self.queues[w]]
        for w in workers:
            self.queues[w] = []
        return out

    async def redispatch(self, requests: Sequence[PartialRequest], workers: Sequence[int]) -> None:
        self.armed.call("redispatch")
        targets = sorted(set(workers) & self.routed)
        if not targets:
            self.parked.extend(r.request_id for r in requests)
            return
        for n, r in enumerate(requests):
            self.queues[targets[n % len(targets)]].append(r.request_id)

    async def release(self, workers: Sequence[int]) -> None:
        self.armed.call("release")
        self.active -= set(workers)

    async def resume(self, workers: Sequence[int]) -> None:
        self.armed.call("resume")
        self.active |= set(workers)
        self.routed |= set(workers)
        for w in workers:
            self.queues.setdefault(w, [])
        parked, self.parked = self.parked, []
        self._place(parked)

    async def activate(self, workers: Sequence[int]) -> None:
        self.armed.call("activate")
        self.active |= set(workers)
        for w in workers:
            self.queues.setdefault(w, [])

    async def admit(self, workers: Sequence[int]) -> None:
        self.armed.call("admit")
        self.routed |= set(workers)
        parked, self.parked = self.parked, []
        self._place(parked)

    def holding(self) -> list[str]:
        return [i for q in self.queues.values() for i in q] + self.parked

    def holds(self, devices: Sequence[int]) -> bool:
        idle = [w for w, q in self.queues.items() if q and w not in self.routed]
        parked_ok = not self.parked if devices else True
        return self.active == self.routed == set(devices) and not idle and parked_ok


class FakeRanks:
    """The ranks of a P2P reshard: each holds the old layout's state, a pending new one,
    or (after its commit) the new one."""

    calls = ("prepare", "transfer", "verify", "commit")

    def __init__(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.armed = Armed()
        self.src, self.dst = set(src), set(dst)
        self.current: dict[int, str | None] = {r: "old" for r in self.src}
        self.pending: set[int] = set()
        self.copied: set[int] = set()
        self.committed: set[int] = set()
        self.rank_fails: dict[tuple[str, int], str] = {}

    async def step(self, step: Step) -> Mapping[int, str]:
        self.armed.call(str(step))
        failed = {}
        for rank in sorted(self.src | self.dst):
            detail = self.rank_fails.pop((str(step), rank), None)
            if detail is not None:
                failed[rank] = detail
                continue
            self._on_rank(step, rank)
        return failed

    def _on_rank(self, step: Step, rank: int) -> None:
        match step:
            case Step.PREPARE if rank in self.dst:
                self.pending.add(rank)
            case Step.TRANSFER if rank in self.pending:
                self.copied.add(rank)
            case Step.COMMIT:
                assert rank not in self.dst or rank in self.copied, "commit before transfer"
                self.current[rank] = "new" if rank in self.dst else None
                self.pending.discard(rank)
                self.committed.add(rank)
            case Step.ROLLBACK if rank not in self.committed:  # a committed rank refuses
                self.pending.discard(rank)
                self.copied.discard(rank)

    async def close(self) -> None:
        pass

    def holds_old(self) -> bool:
        return (
            all(self.current.get(r) == "old" for r in self.src)
            and "new" not in self.current.values()
        )

    def holds_new(self) -> bool:
        return all(self.current.get(r) == "new" for r in self.dst) and all(
            self.current.get(r) is None for r in self.src - self.dst
        )


class FakeService:
    """A restartable component; in place (a side is empty) its roles sleep with their
    state where they are instead of writing a checkpoint."""

    calls = ("save", "stop", "start", "load")

    def __init__(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.armed = Armed()
        self.in_place = not src or not dst
        self.running: tuple[int, ...] = tuple(sorted(src))
        self.live: str | None = STATE if src else None
        self.asleep: tuple[tuple[int, ...], str] | None = None
        if not src:  # its roles sleep with their state where it may wake
            self.asleep = (tuple(sorted(dst)), STATE)
        self.checkpoints: dict[str, str] = {}

    async def save(self) -> str:
        self.armed.call("save")
        if self.in_place:
            return "in-place"
        assert self.live is not None
        name = f"ckpt-{len(self.checkpoints)}"
        self.checkpoints[name] = self.live
        return name

    async def stop(self) -> None:
        self.armed.call("stop")
        if self.in_place and self.running and self.live is not None:
            self.asleep = (self.running, self.live)
        self.running, self.live = (), None

    async def start(self, resources: Sequence[int]) -> None:
        self.armed.call("start")
        assert not self.running, "started twice"
        self.running = tuple(sorted(resources))
        self.live = "blank"
        if self.asleep is not None and self.asleep[0] == self.running:
            self.live, self.asleep = self.asleep[1], None

    async def load(self, checkpoint: str) -> None:
        self.armed.call("load")
        if not self.in_place:
            self.live = self.checkpoints[checkpoint]

    def safe(self) -> bool:
        return STATE in (self.live, self.asleep[1] if self.asleep else None) or (
            STATE in self.checkpoints.values()
        )

    def holds(self, devices: Sequence[int]) -> bool:
        if self.running != tuple(sorted(devices)):
            return False
        if devices:
            return self.live == STATE
        return self.asleep is not None and self.asleep[1] == STATE


def allocations(kind: MigrationKind) -> st.SearchStrategy[tuple[list[int], list[int]]]:
    """Old and new devices, different; both non-empty for P2P (an empty side is a
    reboot in place there)."""
    least = 1 if kind is MigrationKind.P2P else 0
    side = st.lists(st.sampled_from(DEVICES), unique=True, min_size=least, max_size=3)

    def differ(src: list[int], dst: list[int], device: int) -> tuple[list[int], list[int]]:
        if set(src) == set(dst):
            dst = list(set(dst) ^ {device}) or [(device + 1) % len(DEVICES)]
        return sorted(src), sorted(dst)

    return st.builds(differ, side, side, st.sampled_from(DEVICES))


class MigrationKinds(RuleBasedStateMachine):
    """One migration of a random kind between random allocations (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.faults: dict[Step, str] = {}

    @initialize(data=st.data(), kind=st.sampled_from(list(MigrationKind)))
    def start(self, data: st.DataObject, kind: MigrationKind) -> None:
        src, dst = data.draw(allocations(kind), label="src, dst")
        self.kind, self.src, self.dst = kind, src, dst
        common: dict[str, Any] = {
            "migration_id": "m",
            "lease_s": LEASE_S,
            "clock": self.clock.now,
            "on_step": self._on_step,
        }
        self.world: FakeServing | FakeRanks | FakeService
        self.machine: Migration
        if kind is MigrationKind.WORKLOAD:
            self.requests = [f"r{i}" for i in range(data.draw(st.integers(0, 6), label="n"))]
            self.world = FakeServing(src, self.requests)
            donors = [d for d in src if d not in dst]
            self.workload = WorkloadMigration(
                donors=donors,
                remaining=dst,
                added=[d for d in dst if d not in src],
                host=self.world,
                **common,
            )
            self.machine, self.dest = self.workload, donors
        elif kind is MigrationKind.P2P:
            self.world = FakeRanks(src, dst)
            self.machine = P2PGroupMigration(src=src, dst=dst, host=self.world, **common)
            self.dest = dst
        else:
            self.world = FakeService(src, dst)
            self.machine = RebootMigration(
                src_resources=src, dest_resources=dst, host=self.world, **common
            )
            self.dest = dst

    async def _on_step(self, step: Step) -> None:
        fault = self.faults.pop(step, None)
        if fault == "fail":
            raise RuntimeError(f"injected failure at {step}")
        if fault == "stall":
            await self.clock.sleep(self.machine.state.deadline - self.clock.now() + 1.0)

    def _run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    # ------------------------------------------------------------------ faults

    @rule(data=st.data())
    def fail_next_call(self, data: st.DataObject) -> None:
        self.world.armed.names.add(data.draw(st.sampled_from(self.world.calls)))

    @rule(data=st.data())
    def rank_fails_a_step(self, data: st.DataObject) -> None:
        if not isinstance(self.world, FakeRanks):
            return
        forward = KIND_STEPS[MigrationKind.P2P][:-1]
        step = data.draw(st.sampled_from([*forward, Step.ABORT, Step.ROLLBACK]))
        ranks = sorted(self.world.src | self.world.dst)
        if step in (Step.ABORT, Step.ROLLBACK):  # only a joining rank may fail those
            ranks = sorted(self.world.dst - self.world.src)
            if not ranks:
                return
        self.world.rank_fails[(str(step), data.draw(st.sampled_from(ranks)))] = "rank failed"

    @rule(data=st.data(), fault=st.sampled_from(["fail", "stall"]))
    def fault_at_step(self, data: st.DataObject, fault: str) -> None:
        self.faults[data.draw(st.sampled_from(KIND_STEPS[self.kind]))] = fault

    @rule(seconds=st.floats(0, 2 * LEASE_S))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # ------------------------------------------------------------------ the coordinator

    @rule()
    def interrupt(self) -> None:
        self._run(self.machine.interrupt())

    @rule()
    def run_to_commit(self) -> None:
        failed = self._run(self.machine.run_to_commit())
        state = self.machine.state
        if failed is None:
            assert all(state.succeeded(s) for s in state.steps[:-1])
        else:
            assert not failed.ok and not state.committed

    @rule()
    def commit(self) -> None:
        before = self.machine.state
        outcome = self._run(self.machine.commit())
        if outcome.ok:
            assert all(before.succeeded(s) for s in before.steps[:-1]), "committed out of order"
            assert not before.aborted and not before.failed

    @rule()
    def cancel(self) -> None:
        self._cancel()

    @rule()
    def migrate(self) -> None:
        self.world.armed.names.clear()  # migrate may roll back: a rollback's I/O succeeds
        self.faults.clear()
        outcome = self._run(self.machine.migrate(self.dest))
        assert outcome.step in (Step.COMMIT, Step.ROLLBACK)

    def _cancel(self) -> None:
        self.world.armed.names.clear()
        committed = self.machine.state.committed
        outcome = self._run(self.machine.cancel("test"))
        assert outcome.step is Step.ROLLBACK
        assert outcome.ok != committed, outcome  # a committed migration cannot roll back

    # ------------------------------------------------------------------ invariants

    def _holds(self, devices: Sequence[int]) -> bool:
        world = self.world
        if isinstance(world, FakeRanks):
            return world.holds_new() if devices == self.dst else world.holds_old()
        return world.holds(devices)

    @invariant()
    def nothing_lost_or_duplicated(self) -> None:
        if not hasattr(self, "world"):
            return
        world = self.world
        if isinstance(world, FakeServing):
            workload, state = self.workload, self.workload.state
            sent = set(workload.dispatched)
            held = [r.request_id for r in workload.drained if r.request_id not in sent]
            assert sorted(world.holding() + held) == sorted(self.requests)
            assert world.routed <= world.active
            if state.committed or state.rolled_back:  # the migration holds none any more
                assert not held, held
        elif isinstance(world, FakeRanks):
            assert world.holds_old() or world.holds_new(), world.current
        else:
            assert world.safe()

    @invariant()
    def old_or_new_never_both_never_neither(self) -> None:
        if not hasattr(self, "machine"):
            return
        state = self.machine.state
        assert not (state.committed and state.rolled_back)
        if state.committed:
            assert self._holds(self.dst), "committed, but not on the new allocation"
        if state.rolled_back:
            assert self._holds(self.src), "rolled back, but not on the old allocation"

    def teardown(self) -> None:
        try:
            if hasattr(self, "machine"):
                state = self.machine.state
                if not state.committed and not state.rolled_back:
                    self._cancel()
                state = self.machine.state
                assert state.committed or state.rolled_back
                assert self._holds(self.dst if state.committed else self.src)
        finally:
            self.loop.close()


TestMigrationKinds = MigrationKinds.TestCase
