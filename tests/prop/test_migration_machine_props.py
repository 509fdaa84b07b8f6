"""The migration life cycle against a model, and the workload and reboot migrations.

A hypothesis rule-based machine sends random commands (every step of every kind, abort,
rollback, clock jumps past the lease) to :func:`begin`/:func:`finish` and checks each
answer against a small independent model: a replayed command returns its first outcome,
forward steps run only in order before abort, failure or lease expiry, abort is refused
after commit, rollback needs an abort or a failure. Workload and reboot migrations run
against fake hosts that fail on demand: no request is lost or duplicated, every side
effect happens at most once, and a rollback restores the old resources.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dynarl.migrate import (
    Outcome,
    PartialRequest,
    RebootMigration,
    Step,
    WorkloadMigration,
    new_migration,
)
from dynarl.migrate._protocol import KIND_STEPS, begin, finish, record_refusal
from dynarl.types import MigrationKind


class LifeCycle(RuleBasedStateMachine):
    """Commands against the pure machine, checked against an independent model."""

    @initialize(kind=st.sampled_from(list(MigrationKind)))
    def start(self, kind: MigrationKind) -> None:
        self.now = 0.0
        self.state = new_migration("m", kind, now=0.0, lease_s=10.0)
        self.steps = KIND_STEPS[kind]
        self.first: dict[Step, Outcome] = {}
        self.ran: list[Step] = []

    @rule(step=st.sampled_from(list(Step)), ok=st.booleans())
    def command(self, step: Step, ok: bool) -> None:
        done = {s for s, o in self.first.items() if o.ok}
        failed = any(not o.ok and s in self.steps for s, o in self.first.items())
        start = begin(self.state, step, now=self.now)
        if step in self.first:
            assert not start.run and start.outcome == self.first[step]
            return
        if step is Step.ABORT:
            expected = Step.COMMIT not in done
        elif step is Step.ROLLBACK:
            expected = Step.ABORT in done or failed
        else:
            index = self.steps.index(step) if step in self.steps else -1
            expected = (
                index >= 0
                and Step.ABORT not in done
                and not failed
                and all(s in done for s in self.steps[:index])
                and self.now <= self.state.deadline
            )
        assert start.run == expected, (step, start, self.first)
        if start.run:
            self.state = finish(self.state, step, ok=ok or step in (Step.ABORT, Step.ROLLBACK))
            self.ran.append(step)
        else:
            self.state = record_refusal(self.state, start)
        recorded = self.state.outcome(step)
        if recorded is not None:
            self.first[step] = recorded

    @rule()
    def lease_expires(self) -> None:
        self.now = self.state.deadline + 1.0

    @invariant()
    def never_both_committed_and_aborted(self) -> None:
        if hasattr(self, "state"):
            assert not (self.state.committed and self.state.aborted)
            assert len(self.ran) == len(set(self.ran))


TestLifeCycle = LifeCycle.TestCase


class FakeComponent:
    """Workers with queues; can fail one named call once."""

    def __init__(self, inflight: dict[int, list[str]], fail: str | None) -> None:
        self.queues = {w: list(ids) for w, ids in inflight.items()}
        self.routed = set(inflight)
        self.released: set[int] = set()
        self.fail = fail
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        if self.fail == name:
            self.fail = None
            raise RuntimeError(f"{name} failed")
        self.calls.append(name)  # successful calls only

    async def stop_routing(self, workers: Sequence[int]) -> None:
        self._call("stop_routing")
        self.routed -= set(workers)

    async def abort_inflight(self, workers: Sequence[int]) -> Sequence[PartialRequest]:
        self._call("abort_inflight")
        out = []
        for w in workers:
            out += [
                PartialRequest(request_id=i, prompt=(1, 2), generated=(3,)) for i in self.queues[w]
            ]
            self.queues[w] = []
        return out

    async def redispatch(self, requests: Sequence[PartialRequest], workers: Sequence[int]) -> None:
        self._call("redispatch")
        for n, r in enumerate(requests):
            self.queues[workers[n % len(workers)]].append(r.request_id)

    async def release(self, workers: Sequence[int]) -> None:
        self._call("release")
        self.released |= set(workers)

    async def resume(self, workers: Sequence[int]) -> None:
        self._call("resume")
        self.released -= set(workers)
        self.routed |= set(workers)


@given(
    inflight=st.lists(
        st.lists(st.integers(0, 30), unique=True, max_size=5), min_size=3, max_size=3
    ),
    fail=st.sampled_from([None, "stop_routing", "abort_inflight", "redispatch", "release"]),
    repeat=st.booleans(),
)
def test_workload_migration_loses_and_duplicates_nothing(
    inflight: list[list[int]], fail: str | None, repeat: bool
) -> None:
    seen: set[str] = set()
    queues = {}
    for w, ids in enumerate(inflight):
        queues[w] = [f"r{i}" for i in ids if f"r{i}" not in seen]
        seen |= set(queues[w])
    host = FakeComponent(queues, fail)
    migration = WorkloadMigration(migration_id="w", donors=[0], remaining=[1, 2], host=host)

    async def scenario() -> Outcome:
        await migration.interrupt()
        outcome = await migration.migrate([0])
        if repeat:
            again = (
                await migration.migrate([0])
                if outcome.step is Step.COMMIT
                else await migration.cancel("again")
            )
            assert again == outcome
        return outcome

    outcome = asyncio.run(scenario())
    everything = sorted(i for q in host.queues.values() for i in q)
    assert everything == sorted(seen), "a request was lost or duplicated"
    assert all(host.calls.count(c) <= 1 for c in set(host.calls)), host.calls
    if fail is None:
        assert outcome.step is Step.COMMIT and outcome.ok
        assert host.queues[0] == [] and host.released == {0} and 0 not in host.routed
    else:
        assert outcome.step is Step.ROLLBACK and outcome.ok
        assert migration.state.phase == "rolled_back"
        assert host.released == set() and 0 in host.routed


class FakeService:
    def __init__(self, fail: str | None) -> None:
        self.running: tuple[int, ...] | None = (0, 1)
        self.loaded: str | None = "live"
        self.fail = fail
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.fail == name:
            self.fail = None
            raise RuntimeError(f"{name} failed")

    async def save(self) -> str:
        self._call("save")
        return "ckpt-1"

    async def stop(self) -> None:
        self._call("stop")
        self.running, self.loaded = None, None

    async def start(self, resources: Sequence[int]) -> None:
        self._call("start")
        self.running = tuple(resources)

    async def load(self, checkpoint: str) -> None:
        self._call("load")
        self.loaded = checkpoint


@given(fail=st.sampled_from([None, "save", "stop", "start", "load"]))
def test_reboot_migration_commits_or_comes_back_on_old_resources(fail: str | None) -> None:
    service = FakeService(fail)
    migration = RebootMigration(migration_id="r", src_resources=[0, 1], host=service)
    outcome = asyncio.run(migration.migrate([2, 3]))
    if fail is None:
        assert outcome.step is Step.COMMIT and outcome.ok
        assert service.running == (2, 3) and service.loaded == "ckpt-1"
    else:
        assert outcome.step is Step.ROLLBACK and outcome.ok, outcome
        assert service.running == (0, 1)
        assert service.loaded in ("live", "ckpt-1")
    assert asyncio.run(migration.migrate([2, 3])).step is outcome.step
