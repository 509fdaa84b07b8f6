"""The hybrid-replica controller: STANDALONE_ONLY ↔ HYBRID_ACTIVE, in the documented orders.

Activate (after weight sync): sync weights to the hybrid replicas, then
``add_replicas`` (register them with the load balancer) → ``resume_generation_replicas``;
then, when enabled and the policy asks, a rebalance. Deactivate (order is critical):
``remove_replicas`` (cut routing first, so retries cannot land on a dying replica) →
``abort_replicas`` (in-flight requests are retried on standalone replicas with what they
generated) → ``sleep_replicas`` (release KV cache, offload weights, return the devices to
training). The controller performs these through an injected :class:`HybridReplicas` and
times them with the injected clock, so the simulator drives it in virtual time. Runs in
the trainer's loop.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from dynarl.sched._events import Clock
from dynarl.sched._hybrid import DynamicScheduleContext, HybridPolicy

__all__ = ["HybridController", "HybridReplicas", "HybridState", "StepTimings"]

logger = logging.getLogger(__name__)


class HybridState(enum.StrEnum):
    """Whether the hybrid replicas generate."""

    STANDALONE_ONLY = "standalone_only"
    HYBRID_ACTIVE = "hybrid_active"


@runtime_checkable
class HybridReplicas(Protocol):
    """The operations on hybrid replicas the controller performs (the rollout side)."""

    async def add_replicas(self) -> None:
        """Register the hybrid replicas with the load balancer."""
        ...

    async def resume_generation_replicas(self) -> None:
        """Let the hybrid replicas accept requests."""
        ...

    async def remove_replicas(self) -> None:
        """Take the hybrid replicas out of the load balancer."""
        ...

    async def abort_replicas(self) -> None:
        """Abort their in-flight requests (retried elsewhere with partial output)."""
        ...

    async def sleep_replicas(self) -> None:
        """Release their KV cache and weights, returning the devices to training."""
        ...

    async def sync_hybrid_weights(self, global_steps: int) -> None:
        """Push the trainer's latest weights to the hybrid replicas."""
        ...

    async def wait_for_samples(self, count: int) -> None:
        """Return once at least ``count`` samples are buffered."""
        ...

    async def rebalance(self) -> None:
        """Clear sticky routing, abort in-flight requests everywhere, resume (least-loaded)."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimings:
    """What the controller measured around one training step."""

    wait_for_samples_s: float = 0.0
    """Time waiting for the deactivate threshold (the hybrid rollout time), seconds."""
    deactivate_s: float = 0.0
    activate_s: float = 0.0
    deactivated: bool = False
    activated: bool = False


class HybridController:
    """Owns the hybrid replicas' lifecycle; a :class:`HybridPolicy` decides when."""

    def __init__(
        self,
        policy: HybridPolicy,
        replicas: HybridReplicas,
        clock: Clock,
        *,
        num_hybrid_replicas: int,
        enable_rebalance: bool = True,
    ) -> None:
        if num_hybrid_replicas < 0:
            raise ValueError(f"num_hybrid_replicas must be >= 0, got {num_hybrid_replicas}")
        self.policy = policy
        self.replicas = replicas
        self.clock = clock
        self.num_hybrid_replicas = num_hybrid_replicas
        self.enable_rebalance = enable_rebalance
        self.state = HybridState.STANDALONE_ONLY
        self.activate_count = 0
        self.deactivate_count = 0
        self._activate_s = 0.0
        self._deactivate_s = 0.0

    @property
    def is_hybrid_active(self) -> bool:
        """Whether the hybrid replicas are generating."""
        return self.state is HybridState.HYBRID_ACTIVE

    def _with_timings(self, ctx: DynamicScheduleContext) -> DynamicScheduleContext:
        return replace(
            ctx,
            last_activate_duration_s=self._activate_s,
            last_deactivate_duration_s=self._deactivate_s,
        )

    async def before_training_step(
        self, global_steps: int, ctx: DynamicScheduleContext
    ) -> StepTimings:
        """Policy steps 1–2: maybe wait for enough samples, then deactivate."""
        ctx = self._with_timings(ctx)
        if not self.policy.should_deactivate(global_steps, self.is_hybrid_active, ctx):
            return StepTimings()
        threshold = self.policy.deactivate_wait_samples(ctx)
        start = self.clock.now()
        await self.replicas.wait_for_samples(threshold)
        waited = self.clock.now() - start
        start = self.clock.now()
        await self.deactivate(global_steps)
        took = self.clock.now() - start
        self._deactivate_s += took
        return StepTimings(wait_for_samples_s=waited, deactivate_s=took, deactivated=True)

    async def after_weight_sync(
        self, global_steps: int, ctx: DynamicScheduleContext
    ) -> StepTimings:
        """Policy steps 3–5: maybe activate (and rebalance), then update the policy."""
        ctx = self._with_timings(ctx)
        activate = self.policy.should_activate_after_step(global_steps, self.is_hybrid_active, ctx)
        took = 0.0
        if activate:
            start = self.clock.now()
            await self.replicas.sync_hybrid_weights(global_steps)
            await self.activate(global_steps)
            if self.enable_rebalance and self.policy.request_rebalance(global_steps, ctx):
                await self.replicas.rebalance()
            took = self.clock.now() - start
            self._activate_s += took
        self.policy.update_after_step(global_steps, self._with_timings(ctx))
        self._activate_s = self._deactivate_s = 0.0
        return StepTimings(activate_s=took, activated=activate)

    async def activate(self, global_steps: int) -> None:
        """add_replicas → resume_generation_replicas (no-op without hybrid replicas)."""
        if not self.num_hybrid_replicas:
            logger.info("step %d: no hybrid replicas, activation skipped", global_steps)
            return
        await self.replicas.add_replicas()
        await self.replicas.resume_generation_replicas()
        self.state = HybridState.HYBRID_ACTIVE
        self.activate_count += 1
        logger.info("step %d: hybrid replicas active (%d)", global_steps, self.activate_count)

    async def deactivate(self, global_steps: int) -> None:
        """remove_replicas → abort_replicas → sleep_replicas (no-op without hybrid replicas)."""
        if not self.num_hybrid_replicas:
            self.state = HybridState.STANDALONE_ONLY
            return
        await self.replicas.remove_replicas()
        await self.replicas.abort_replicas()
        await self.replicas.sleep_replicas()
        self.state = HybridState.STANDALONE_ONLY
        self.deactivate_count += 1
        logger.info("step %d: hybrid replicas asleep (%d)", global_steps, self.deactivate_count)
