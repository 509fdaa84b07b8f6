"""Rollout under migration: a stateful machine, and the vector model against the per-request one.

The machine starts an iteration (agentic, so turns, tool calls and prefix caches are in
play) and interleaves virtual time with engine removals (workload migration: aborted
requests re-submitted with their partial output), additions and rebalances. After every
step no sample is live twice; at the end every sample has finished exactly once. The
differential test runs single-turn batches on both rollout models and compares when the
last sample finishes (KV budgets of a few sequences and up: the vector model never evicts
a group's cached prompt, the per-request one does when the KV is nearly full).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sim_support import small

from dynarl.sched import FifoPolicy, PriorityPolicy
from dynarl.sim import EventLoop, Rollout, build_trace
from dynarl.sim._vector import VectorRollout


class MigrationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        workload = small("agentic", num_gpus=8, num_prompts=8)
        self.workload = replace(workload, batch=replace(workload.batch, group_size=4))
        self.loop = EventLoop()
        self.done: Counter[int] = Counter()
        self.rollout = Rollout(
            self.workload, self.loop, PriorityPolicy, lambda _it, s: self.done.update([s])
        )
        self.spare: list[tuple[int, ...]] = []
        self.rollout.add_devices(range(8))
        self.trace = build_trace(self.workload, 0)
        self.rollout.start(self.trace)

    @rule(dt=st.floats(min_value=0.05, max_value=3.0))
    def advance(self, dt: float) -> None:
        self.loop.run(until=self.loop.now + dt, max_events=1_000_000)
        self.loop.clock.time = max(self.loop.clock.time, self.loop.now)

    @precondition(lambda self: len(self.rollout.engines) > 1)
    @rule(pick=st.integers(min_value=0, max_value=7))
    def remove(self, pick: int) -> None:
        engines = sorted(self.rollout.engines.values(), key=lambda e: e.index)
        engine = engines[pick % len(engines)]
        self.rollout.remove_devices(engine.devices)
        self.spare.append(engine.devices)

    @precondition(lambda self: bool(self.spare))
    @rule()
    def add(self) -> None:
        self.rollout.add_devices(self.spare.pop())

    @rule()
    def rebalance(self) -> None:
        self.rollout.rebalance()

    @invariant()
    def no_sample_is_live_twice(self) -> None:
        live = Counter(r.sample for e in self.rollout.engines.values() for r in e.running.values())
        live.update(r.sample for e in self.rollout.engines.values() for r in e.waiting.values())
        live.update(r.sample for r in self.rollout.pending)
        assert not [s for s, n in live.items() if n > 1]
        assert not set(live) & set(self.done)
        assert all(n == 1 for n in self.done.values())

    def teardown(self) -> None:
        if not self.rollout.engines:
            self.rollout.add_devices(self.spare.pop())
        self.loop.run(until=1e7, max_events=10_000_000)
        assert sorted(self.done) == list(range(self.trace.num_samples))
        assert all(n == 1 for n in self.done.values())


TestMigrationMachine = MigrationMachine.TestCase
TestMigrationMachine.settings = settings(stateful_step_count=25)


@given(
    sigma=st.floats(min_value=0.2, max_value=1.2),
    capacity=st.integers(min_value=30_000, max_value=200_000),
    running=st.integers(min_value=4, max_value=128),
    gpus=st.sampled_from([2, 4, 8]),
)
@settings(max_examples=25)
# Retraction among a group's siblings (equal progress and input): both models must break
# the tie the same way (the newest request first), or one finishes ~3% later.
@example(sigma=1.1875, capacity=30_000, running=34, gpus=2)
def test_vector_model_agrees_with_per_request_model(
    sigma: float, capacity: int, running: int, gpus: int
) -> None:
    base = small("math", num_gpus=8, num_prompts=16)
    workload = replace(
        base,
        lengths=replace(base.lengths, output_sigma=sigma),
        rollout=replace(base.rollout, kv_capacity_tokens=capacity, max_running_requests=running),
    )
    trace = build_trace(workload, 0)
    finish: dict[str, float] = {}
    for name, cls in (("request", Rollout), ("vector", VectorRollout)):
        loop = EventLoop()
        left = [trace.num_samples]

        def done(_it: int, _s: int, loop: EventLoop = loop, left: list[int] = left) -> None:
            left[0] -= 1

        rollout = cls(workload, loop, FifoPolicy, done)
        rollout.add_devices(range(gpus))
        rollout.start(trace)
        t = 0.0
        while left[0] and t < 1e6:
            t += 0.25
            loop.run(until=t, max_events=10_000_000)
            loop.clock.time = t
            if isinstance(rollout, VectorRollout):
                rollout.report(remaining=0, iteration=0)  # brings it to now
        finish[name] = t
    assert abs(finish["vector"] - finish["request"]) <= 0.02 * finish["request"] + 0.5
