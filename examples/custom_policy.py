"""Policies of your own: a request policy for the engines and a hybrid-replica policy.

**Request policy** (:class:`dynarl.sched.RequestPolicy`): orders the requests waiting in
one engine; smaller keys go first, arrival breaks ties, and the queue's aging bound
(``max_overtakes``) still stops any request from starving. :class:`CacheFirstPolicy`
serves the request with the most reusable cached prefix first (its prefill is cheapest),
then the one whose episode has generated least. The script runs the simulator's ``dynarl``
policy on a small agentic workload with FIFO, DynaRL's priority and this policy in the
engines, on the same trace (which order wins depends on the workload: measure yours).

**Hybrid policy** (:class:`dynarl.sched.HybridPolicy`, registered by name with
:func:`dynarl.sched.register_policy`): decides when replicas on the trainer's devices
generate. :class:`WarmupPolicy` keeps them asleep for the first ``warmup_steps`` steps
(while the first weights are too stale to be worth generating with), then activates
while the buffer is short of ``deactivate_ratio`` of a cycle. The script drives it with
dynarl's :class:`~dynarl.sched.HybridController` in virtual time against fake replicas,
and prints the ``dynamic_resource/*`` metrics of each cycle.

``examples/test_custom_policy.py`` property-tests both with ``dynarl.testing`` only.

Run: ``.venv/bin/python examples/custom_policy.py`` (a few seconds).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from dynarl.sched import (
    DynamicResourceMetrics,
    DynamicScheduleContext,
    FifoPolicy,
    HybridController,
    ManualClock,
    PriorityPolicy,
    QueuedRequest,
    RequestPolicy,
    build_policy,
    register_policy,
)
from dynarl.sim import Simulation, load_workload, with_overrides
from dynarl.sim.policies import DynarlPolicy

WORKLOAD = Path(__file__).parent / "workloads" / "agentic-1.5b-64gpu.toml"


@dataclass(frozen=True, slots=True)
class CacheFirstPolicy:
    """Most reusable cached prefix first, then least attained service."""

    name: str = "cache-first"

    def key(self, request: QueuedRequest) -> tuple[float, ...]:
        """``(-cached_prefix, attained_service)``."""
        return (-request.cached_prefix, request.attained_service)


@register_policy("warmup")
class WarmupPolicy:
    """No hybrid generation for ``warmup_steps`` steps, then a fixed-ratio gap check."""

    def __init__(self, warmup_steps: int = 2, deactivate_ratio: float = 0.5) -> None:
        if warmup_steps < 0 or not 0.0 <= deactivate_ratio <= 1.0:
            raise ValueError("WarmupPolicy: warmup_steps >= 0 and deactivate_ratio in [0, 1]")
        self.warmup_steps = warmup_steps
        self.deactivate_ratio = deactivate_ratio

    def should_deactivate(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """Deactivate whenever active (the trainer needs its devices back)."""
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        """Buffer ``deactivate_ratio`` of a cycle before handing the devices back."""
        return int(self.deactivate_ratio * ctx.step_required_samples)

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """After the warm-up, activate while the surplus is short of the threshold."""
        if global_steps < self.warmup_steps:
            return False
        surplus = ctx.total_generated_samples - ctx.expected_samples
        return surplus < self.deactivate_ratio * ctx.step_required_samples

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        """Rebalance after activating."""
        return True

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        """Nothing adapts."""


def compare_request_policies() -> None:
    """The dynarl policy in the simulator, with three orders in the engines' queues."""
    workload = with_overrides(
        load_workload(WORKLOAD),
        # Small and KV-bound, so that requests wait and the order matters.
        {
            "cluster.num_gpus": 16,
            "batch.num_prompts": 64,
            "batch.group_size": 4,
            "rollout.kv_capacity_tokens": 60_000,
        },
    )
    factories: dict[str, type[RequestPolicy]] = {
        "fifo": FifoPolicy,
        "priority": PriorityPolicy,
        "cache-first": CacheFirstPolicy,
    }
    for name, factory in factories.items():
        result = Simulation(workload, request_policy=factory).run(DynarlPolicy())
        print(
            f"  {name:12s} {result.throughput:6.3f} {result.unit}, "
            f"iteration {result.iteration_s:6.1f} s, "
            f"re-prefilled {result.reprefill_share:.1%} of prefill tokens"
        )


class FakeReplicas:
    """Hybrid replicas in virtual time: every operation takes a fixed time; samples
    arrive at a fixed rate while anyone generates."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.samples = 0
        self.log: list[str] = []

    async def _take(self, what: str, seconds: float) -> None:
        self.log.append(what)
        self.clock.advance(seconds)

    async def add_replicas(self) -> None:
        await self._take("add", 0.5)

    async def resume_generation_replicas(self) -> None:
        await self._take("resume", 0.5)

    async def remove_replicas(self) -> None:
        await self._take("remove", 0.1)

    async def abort_replicas(self) -> None:
        await self._take("abort", 0.2)

    async def sleep_replicas(self) -> None:
        await self._take("sleep", 1.0)

    async def sync_hybrid_weights(self, global_steps: int) -> None:
        await self._take("sync", 2.0)

    async def wait_for_samples(self, count: int) -> None:
        missing = max(count - self.samples, 0)
        await self._take(f"wait {missing}", missing / 16.0)
        self.samples = max(self.samples, count)

    async def rebalance(self) -> None:
        await self._take("rebalance", 0.3)


async def drive_hybrid_policy(num_steps: int = 5) -> None:
    """The registered ``warmup`` policy under dynarl's hybrid controller."""
    clock = ManualClock()
    replicas = FakeReplicas(clock)
    controller = HybridController(
        build_policy("warmup", warmup_steps=2), replicas, clock, num_hybrid_replicas=2
    )
    metrics = DynamicResourceMetrics(hybrid_devices=4, standalone_devices=12)
    for step in range(num_steps):
        ctx = DynamicScheduleContext(
            required_samples=64,
            trigger_parameter_sync_step=1,
            total_generated_samples=replicas.samples,
            expected_samples=64 * step,
        )
        start = clock.now()
        before = await controller.before_training_step(step, ctx)
        clock.advance(3.0)  # the training step itself
        replicas.samples += 48  # standalone replicas generated meanwhile
        after = await controller.after_weight_sync(step, ctx)
        metrics.add_step(
            timing={"update_actor": 3.0},
            allocated_s=clock.now() - start,
            step_s=clock.now() - start,
            wait_for_samples_s=before.wait_for_samples_s,
            mq_size=max(replicas.samples - 64 * (step + 1), 0),
        )
        cycle = metrics.cycle(rollout_utilization=0.8)
        print(
            f"  step {step}: hybrid {'active' if after.activated else 'asleep':6s} "
            f"train util {cycle['dynamic_resource/train_resource_utilization']:.2f}, "
            f"overall {cycle['dynamic_resource/resource_utilization']:.2f}"
        )
    print(f"  replica operations: {' '.join(replicas.log)}")


def main() -> None:
    print("request policies on the same trace (dynarl scheduler in the simulator):")
    compare_request_policies()
    print("hybrid policy 'warmup' under the hybrid controller (virtual time):")
    asyncio.run(drive_hybrid_policy())


if __name__ == "__main__":
    main()
