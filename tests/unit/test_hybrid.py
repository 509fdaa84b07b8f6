"""Hybrid policies, their registry, the controller's step orders, and seed 004's examples."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from dynarl.sched import (
    DynamicScheduleContext,
    HybridController,
    ManualClock,
    build_policy,
    register_policy,
)
from dynarl.sched._hybrid import (
    DefaultHybridPolicy,
    FixedRatioPolicy,
    StaticFullyAsyncPolicy,
    registered_policies,
)
from dynarl.sched._replicas import HybridState


def ctx(**overrides: object) -> DynamicScheduleContext:
    values: dict[str, object] = {
        "required_samples": 10,
        "trigger_parameter_sync_step": 4,
        "total_generated_samples": 100,
        "expected_samples": 100,
        "buffer_samples": 10,
    }
    values.update(overrides)
    return DynamicScheduleContext(**values)  # type: ignore[arg-type]


# ------------------------------------------------------------------ registry


def test_builtin_policies_are_registered_by_default_and_custom_ones_can_be() -> None:
    assert {"default", "static_fully_async", "fixed_ratio"} <= set(registered_policies())
    assert isinstance(build_policy("default"), DefaultHybridPolicy)
    assert isinstance(build_policy("static_fully_async"), StaticFullyAsyncPolicy)
    policy = build_policy("fixed_ratio", deactivate_ratio=0.6)
    assert isinstance(policy, FixedRatioPolicy) and policy.deactivate_ratio == 0.6
    with pytest.raises(ValueError, match="Unknown dynamic scheduling policy 'missing'"):
        build_policy("missing")

    @register_policy("always_on")
    def always_on() -> StaticFullyAsyncPolicy:
        return StaticFullyAsyncPolicy(deactivate_ratio=0.0)

    assert isinstance(build_policy("always_on"), StaticFullyAsyncPolicy)


def test_context_derives_step_required_samples() -> None:
    assert ctx().step_required_samples == 40
    with pytest.raises(ValueError, match="trigger_parameter_sync_step"):
        ctx(trigger_parameter_sync_step=0)


# ------------------------------------------------------------------ default


def test_default_deactivates_whenever_active_after_ratio_samples() -> None:
    policy = DefaultHybridPolicy(deactivate_ratio=0.5)
    assert policy.should_deactivate(1, True, ctx())
    assert not policy.should_deactivate(1, False, ctx())
    assert policy.deactivate_wait_samples(ctx()) == 20


def test_default_adapts_the_ratio_from_really_waited_samples() -> None:
    policy = DefaultHybridPolicy(deactivate_ratio=0.5)
    policy.update_after_step(1, ctx(step_wait_times=(2.0,), step_wait_samples=(2,)))
    assert policy.deactivate_ratio == pytest.approx(0.55)  # + clip(2/40, 0.02, 0.1)
    policy.update_after_step(2, ctx(step_wait_times=(0.0,), step_wait_samples=(0,)))
    assert policy.deactivate_ratio == pytest.approx(0.53)
    policy.update_after_step(3, ctx(required_samples=100, step_wait_samples=(1,)))
    assert policy.deactivate_ratio == pytest.approx(0.55)  # 1/400: at least +0.02
    policy.update_after_step(4, ctx(step_wait_samples=(400,)))
    assert policy.deactivate_ratio == pytest.approx(0.65)  # huge shortfall: at most +0.1
    policy.update_after_step(0, ctx(step_wait_samples=(400,)))
    assert policy.deactivate_ratio == pytest.approx(0.65)  # step 0 is not adapted


def test_ratio_is_clamped_to_unit_interval_unless_verl_behaviour_is_asked_for() -> None:
    clamped = DefaultHybridPolicy(deactivate_ratio=0.03)
    verl = DefaultHybridPolicy(deactivate_ratio=0.03, clamp_ratio=False)
    for step in range(1, 5):
        clamped.update_after_step(step, ctx())
        verl.update_after_step(step, ctx())
    assert clamped.deactivate_ratio == 0.0
    assert verl.deactivate_ratio == pytest.approx(-0.05)  # verl drifts below zero
    assert verl.deactivate_wait_samples(ctx()) == -2  # int(-0.05 × 40): deactivate at once
    high = DefaultHybridPolicy(deactivate_ratio=0.97, clamp_ratio=False)
    high.update_after_step(1, ctx(step_wait_samples=(40,)))
    assert high.deactivate_ratio == 1.0  # verl caps the increase itself


def test_activation_gate_compares_gap_times_per_sample_time_with_switch_cost() -> None:
    policy = DefaultHybridPolicy(deactivate_ratio=0.5)
    # gap = 0.5 × 40 − (110 − 100) = 10 samples.
    low = ctx(total_generated_samples=110, step_wait_times=(1.0,), step_wait_samples=(10,))
    high = ctx(total_generated_samples=110, step_wait_times=(20.0,), step_wait_samples=(10,))
    assert not policy.should_activate_after_step(1, False, low)  # 10 × 0.1 s = 1 s < 10 s
    assert policy.should_activate_after_step(2, False, high)  # 10 × 2 s = 20 s > 10 s
    assert not policy.should_activate_after_step(3, False, ctx(total_generated_samples=120))


def test_per_sample_time_starts_pessimistic_and_keeps_the_last_signal() -> None:
    policy = DefaultHybridPolicy(deactivate_ratio=0.5)
    assert policy.per_sample_time_s == 1000.0
    # gap of 1 sample × 1000 s > 10 s: activates before any signal.
    assert policy.should_activate_after_step(1, False, ctx(total_generated_samples=119))
    policy.should_activate_after_step(2, False, ctx(step_wait_times=(3.0,), step_wait_samples=(6,)))
    assert policy.per_sample_time_s == 0.5
    policy.should_activate_after_step(3, False, ctx(step_wait_times=(0.0,), step_wait_samples=(0,)))
    assert policy.per_sample_time_s == 0.5  # no fresh signal: last estimate stays


def test_switch_cost_is_the_rolling_mean_of_the_last_three() -> None:
    policy = DefaultHybridPolicy()
    assert policy.switch_cost() == 10.0
    for step, (act, deact) in enumerate([(1.0, 1.0), (2.0, 2.0), (3.0, 3.0), (5.0, 5.0)], 1):
        policy.update_after_step(
            step, ctx(last_activate_duration_s=act, last_deactivate_duration_s=deact)
        )
    assert policy.switch_cost() == pytest.approx((4.0 + 6.0 + 10.0) / 3)


def test_only_hybrid_forces_full_ratio_and_activation() -> None:
    for policy in (
        DefaultHybridPolicy(deactivate_ratio=0.2, only_hybrid=True),
        FixedRatioPolicy(0.2, True),
    ):
        assert policy.deactivate_ratio == 1.0
        assert policy.deactivate_wait_samples(ctx()) == 40
        assert policy.should_activate_after_step(1, False, ctx(total_generated_samples=10_000))
    default = DefaultHybridPolicy(only_hybrid=True)
    default.update_after_step(1, ctx(step_wait_samples=(40,)))
    assert default.deactivate_ratio == 1.0  # adaptation disabled


def test_static_policy_is_plain_fully_async() -> None:
    policy = StaticFullyAsyncPolicy()
    assert policy.should_deactivate(1, True, ctx())
    assert policy.deactivate_wait_samples(ctx()) == 0
    assert not policy.should_activate_after_step(1, False, ctx(total_generated_samples=0))
    assert not policy.request_rebalance(1, ctx())


def test_fixed_ratio_never_adapts_and_uses_a_pure_gap_check() -> None:
    policy = FixedRatioPolicy(deactivate_ratio=0.5)
    policy.update_after_step(1, ctx(step_wait_times=(10.0,), step_wait_samples=(40,)))
    assert policy.deactivate_ratio == 0.5
    assert policy.deactivate_wait_samples(ctx()) == 20
    assert policy.should_activate_after_step(1, False, ctx(total_generated_samples=119))
    assert not policy.should_activate_after_step(1, False, ctx(total_generated_samples=120))


# ------------------------------------------------------------------ controller


class Replicas:
    """Records every call; each takes one virtual second; tracks the sample buffer."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.calls: list[str] = []
        self.buffered = 0
        self.rate = 1  # samples per virtual second while waiting

    async def _op(self, name: str) -> None:
        self.calls.append(name)
        self.clock.advance(1.0)

    async def add_replicas(self) -> None:
        await self._op("add_replicas")

    async def resume_generation_replicas(self) -> None:
        await self._op("resume_generation_replicas")

    async def remove_replicas(self) -> None:
        await self._op("remove_replicas")

    async def abort_replicas(self) -> None:
        await self._op("abort_replicas")

    async def sleep_replicas(self) -> None:
        await self._op("sleep_replicas")

    async def sync_hybrid_weights(self, global_steps: int) -> None:
        await self._op("sync_hybrid_weights")

    async def rebalance(self) -> None:
        await self._op("rebalance")

    async def wait_for_samples(self, count: int) -> None:
        self.calls.append(f"wait_for_samples({count})")
        while self.buffered < count:
            self.buffered += self.rate
            self.clock.advance(1.0)


def test_controller_orders_and_timings() -> None:
    clock = ManualClock()
    replicas = Replicas(clock)
    policy = DefaultHybridPolicy(deactivate_ratio=0.5)
    controller = HybridController(policy, replicas, clock, num_hybrid_replicas=2)
    step = ctx(total_generated_samples=100, expected_samples=100)

    async def cycle() -> None:
        timings = await controller.after_weight_sync(1, step)
        assert timings.activated and timings.activate_s == 4.0
        assert controller.state is HybridState.HYBRID_ACTIVE
        replicas.buffered = 15
        timings = await controller.before_training_step(2, step)
        # No real waits in cycle 1: the ratio fell to 0.48, so 19 samples; 4 s to go.
        assert timings.deactivated and timings.wait_for_samples_s == 4.0
        assert timings.deactivate_s == 3.0
        assert controller.state is HybridState.STANDALONE_ONLY

    asyncio.run(cycle())
    assert replicas.calls == [
        "sync_hybrid_weights",
        "add_replicas",
        "resume_generation_replicas",
        "rebalance",
        "wait_for_samples(19)",
        "remove_replicas",
        "abort_replicas",
        "sleep_replicas",
    ]
    # The policy saw the cycle's activation cost when it updated (4 s; deactivate is
    # charged to the next cycle, as in verl).
    assert policy.switch_costs == [4.0]


def test_rebalance_only_when_enabled_and_requested() -> None:
    clock = ManualClock()
    replicas = Replicas(clock)
    off = HybridController(
        FixedRatioPolicy(0.5), replicas, clock, num_hybrid_replicas=1, enable_rebalance=False
    )
    asyncio.run(off.after_weight_sync(1, ctx(total_generated_samples=0)))
    assert "rebalance" not in replicas.calls and off.is_hybrid_active
    replicas.calls.clear()
    static = HybridController(StaticFullyAsyncPolicy(), replicas, clock, num_hybrid_replicas=1)
    static.state = HybridState.HYBRID_ACTIVE
    asyncio.run(static.before_training_step(1, ctx()))
    asyncio.run(static.after_weight_sync(1, ctx(total_generated_samples=0)))
    assert replicas.calls == [
        "wait_for_samples(0)",
        "remove_replicas",
        "abort_replicas",
        "sleep_replicas",
    ]
    none = HybridController(FixedRatioPolicy(0.5), replicas, clock, num_hybrid_replicas=0)
    asyncio.run(none.after_weight_sync(1, ctx(total_generated_samples=0)))
    assert not none.is_hybrid_active


def test_the_three_example_steps_of_seed_004() -> None:
    """Steps 1 and 2: the queue lacks samples, hybrid helps roll out and then trains.

    Step 3: enough samples are already buffered, so hybrid skips rollout entirely and
    the second (hybrid) weight sync is skipped.
    """
    clock = ManualClock()
    replicas = Replicas(clock)
    policy = DefaultHybridPolicy(deactivate_ratio=0.5)
    controller = HybridController(policy, replicas, clock, num_hybrid_replicas=4)
    base = DynamicScheduleContext(required_samples=10, trigger_parameter_sync_step=1)
    log: dict[int, list[str]] = {}

    async def run() -> None:
        # Start of training (after the initial sync): nothing generated, so activate.
        await controller.after_weight_sync(0, base)
        # By the end of each step: samples produced, and this cycle's real waits.
        generated = {1: 12, 2: 30, 3: 40}
        waits = {1: (30.0,), 2: (20.0,), 3: ()}
        for step in (1, 2, 3):
            replicas.calls.clear()
            replicas.buffered = 0
            await controller.before_training_step(step, base)
            state = replace(
                base,
                total_generated_samples=generated[step],
                expected_samples=10 * step,
                step_wait_times=waits[step],
                step_wait_samples=tuple(3 for _ in waits[step]),
            )
            await controller.after_weight_sync(step, state)
            log[step] = list(replicas.calls)

    asyncio.run(run())
    deactivate = ["remove_replicas", "abort_replicas", "sleep_replicas"]
    reactivate = ["sync_hybrid_weights", "add_replicas", "resume_generation_replicas", "rebalance"]
    # Step 1: hybrid rolled out until 0.5 × 10 samples were buffered, then trained. The
    # gap after it (5 − (12 − 10) = 3 samples × 10 s each = 30 s) beats the 10 s switch
    # cost, so it rolls out again.
    assert log[1] == ["wait_for_samples(5)", *deactivate, *reactivate]
    # Step 2: the real waits raised the ratio to 0.6; afterwards the queue's surplus
    # (30 − 20 = 10) covers the threshold, so hybrid is not re-activated.
    assert log[2] == ["wait_for_samples(6)", *deactivate]
    # Step 3: straight to training; no hybrid rollout, no hybrid weight sync.
    assert log[3] == []
    assert policy.switch_costs == [7.0, 3.0]
    assert policy.deactivate_ratio == pytest.approx(0.68)
    assert controller.state is HybridState.STANDALONE_ONLY
    assert controller.activate_count == 2 and controller.deactivate_count == 2
