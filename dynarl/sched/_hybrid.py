"""Hybrid-replica policies (after verl's dynamic resource scheduling for fully-async RL).

Standalone rollout replicas always generate; hybrid replicas on the trainer's devices
generate only while the trainer waits. A :class:`HybridPolicy` decides, per training
step, in this order: :meth:`~HybridPolicy.should_deactivate` (before training),
:meth:`~HybridPolicy.deactivate_wait_samples` (if so: samples to buffer first),
:meth:`~HybridPolicy.should_activate_after_step` (after weight sync),
:meth:`~HybridPolicy.request_rebalance` (after an activation) and
:meth:`~HybridPolicy.update_after_step` (after weight sync). Policies are registered by
name (:func:`register_policy`, :func:`build_policy`); ``default``, ``static_fully_async``
and ``fixed_ratio`` are registered on import. ``default`` keeps its adaptive ratio in
[0, 1]; ``clamp_ratio=False`` reproduces verl exactly (its increase is capped at 1, its
decrease is not bounded, so the ratio can drift below zero). Policies are plain objects
used from one loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

__all__ = [
    "DefaultHybridPolicy",
    "DynamicScheduleContext",
    "FixedRatioPolicy",
    "HybridPolicy",
    "StaticFullyAsyncPolicy",
    "build_policy",
    "register_policy",
    "registered_policies",
]

logger = logging.getLogger(__name__)

DEFAULT_SWITCH_COST_S = 10.0
"""Switch (activate + deactivate) cost assumed with no measurement yet, seconds."""
SWITCH_COST_WINDOW = 3
"""Measured switch costs averaged."""
RATIO_INCREASE_MIN = 0.02
RATIO_INCREASE_MAX = 0.1
RATIO_DECREASE = 0.02
INITIAL_PER_SAMPLE_TIME_S = 1000.0
"""Pessimistic per-sample time before any real generation-rate signal, seconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DynamicScheduleContext:
    """What a policy sees at one step (static run facts plus per-step state)."""

    required_samples: int
    """Samples per collection (ppo_mini_batch_size × require_batches)."""
    trigger_parameter_sync_step: int
    """Collections per weight-sync cycle."""
    total_generated_samples: int = 0
    """Rollout samples produced since training began."""
    expected_samples: int = 0
    """Samples needed up to the current sync step."""
    buffer_samples: float = 0.0
    """Allowed buffer headroom (expected × staleness_threshold)."""
    step_wait_times: tuple[float, ...] = ()
    """Per-collection wait times in the latest cycle, seconds."""
    step_wait_samples: tuple[int, ...] = ()
    """Per-collection samples that really had to be waited for (not served from backlog)."""
    only_hybrid: bool = False
    """No standalone replicas."""
    last_activate_duration_s: float = 0.0
    """Time of this cycle's activation (weight sync + onload), seconds."""
    last_deactivate_duration_s: float = 0.0
    """Time of this cycle's deactivation (offload), seconds."""
    step_required_samples: int = field(init=False)
    """required_samples × trigger_parameter_sync_step: samples of one sync cycle."""

    def __post_init__(self) -> None:
        if self.required_samples < 0 or self.trigger_parameter_sync_step < 1:
            raise ValueError(
                "DynamicScheduleContext needs required_samples >= 0 and "
                "trigger_parameter_sync_step >= 1"
            )
        steps = self.required_samples * self.trigger_parameter_sync_step
        object.__setattr__(self, "step_required_samples", steps)


@runtime_checkable
class HybridPolicy(Protocol):
    """Decides when hybrid replicas switch between rollout and training."""

    def should_deactivate(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """Before training: deactivate the hybrid replicas this step?"""
        ...

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        """Samples to have buffered before deactivating."""
        ...

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """After weight sync: (re-)activate the hybrid replicas?"""
        ...

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        """After an activation: redistribute requests across all replicas?"""
        ...

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        """After weight sync: update internal state."""
        ...


P = TypeVar("P", bound=Callable[..., HybridPolicy])
_REGISTRY: dict[str, Callable[..., HybridPolicy]] = {}


def register_policy(name: str) -> Callable[[P], P]:
    """Decorator: register a policy factory (a class or function) under ``name``."""

    def decorator(factory: P) -> P:
        _REGISTRY[name] = factory
        return factory

    return decorator


def build_policy(name: str, **kwargs: object) -> HybridPolicy:
    """Build the policy registered as ``name``; raises ValueError for an unknown name."""
    if name not in _REGISTRY:
        raise ValueError(
            f"Unknown dynamic scheduling policy {name!r}. Registered: {registered_policies()}"
        )
    return _REGISTRY[name](**kwargs)


def registered_policies() -> tuple[str, ...]:
    """Registered policy names, sorted."""
    return tuple(sorted(_REGISTRY))


def _check_ratio(ratio: float) -> None:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"deactivate_ratio must be in [0, 1], got {ratio}")


@register_policy("default")
class DefaultHybridPolicy:
    """Adaptive deactivate ratio plus a cost/benefit activation gate (verl's default)."""

    def __init__(
        self, deactivate_ratio: float = 0.3, only_hybrid: bool = False, clamp_ratio: bool = True
    ) -> None:
        _check_ratio(deactivate_ratio)
        self.deactivate_ratio = 1.0 if only_hybrid else deactivate_ratio
        self.only_hybrid = only_hybrid
        self.clamp_ratio = clamp_ratio
        self.switch_costs: list[float] = []
        self.per_sample_time_s = INITIAL_PER_SAMPLE_TIME_S

    def should_deactivate(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """Deactivate whenever active."""
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        """``int(deactivate_ratio × step_required_samples)``."""
        return int(ctx.step_required_samples * self.deactivate_ratio)

    def switch_cost(self) -> float:
        """Mean of the last 3 measured activate + deactivate durations (10 s with none)."""
        recent = self.switch_costs[-SWITCH_COST_WINDOW:]
        return sum(recent) / len(recent) if recent else DEFAULT_SWITCH_COST_S

    def gap(self, ctx: DynamicScheduleContext) -> float:
        """Samples still missing to reach the deactivate threshold."""
        surplus = ctx.total_generated_samples - ctx.expected_samples
        return self.deactivate_ratio * ctx.step_required_samples - surplus

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """Activate when there is a gap and gap × per-sample time exceeds the switch cost."""
        if self.only_hybrid:
            return True
        gap = self.gap(ctx)
        if gap <= 0:
            return False
        total_wait, wait_samples = sum(ctx.step_wait_times), sum(ctx.step_wait_samples)
        if total_wait > 0 and wait_samples > 0:
            self.per_sample_time_s = total_wait / wait_samples
        return gap * self.per_sample_time_s - self.switch_cost() > 0

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        """Always rebalance after activating."""
        return True

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        """Record the switch cost and adapt the ratio from the real waits of this cycle."""
        if global_steps <= 0 or self.only_hybrid:
            return
        overhead = ctx.last_activate_duration_s + ctx.last_deactivate_duration_s
        if overhead > 0:
            self.switch_costs.append(overhead)
        waited = sum(ctx.step_wait_samples)
        before = self.deactivate_ratio
        if waited > 0:
            cycle = ctx.step_required_samples
            raw = waited / cycle if cycle > 0 else RATIO_INCREASE_MAX
            step = min(RATIO_INCREASE_MAX, max(RATIO_INCREASE_MIN, raw))
            self.deactivate_ratio = min(1.0, self.deactivate_ratio + step)
        else:
            self.deactivate_ratio -= RATIO_DECREASE
        if self.clamp_ratio:
            self.deactivate_ratio = min(max(self.deactivate_ratio, 0.0), 1.0)
        logger.info(
            "step %d: deactivate_ratio %.3f -> %.3f", global_steps, before, self.deactivate_ratio
        )


@register_policy("static_fully_async")
class StaticFullyAsyncPolicy:
    """Plain fully-async: deactivate at once every step, never re-activate."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False) -> None:
        _check_ratio(deactivate_ratio)
        self.deactivate_ratio = 1.0 if only_hybrid else deactivate_ratio
        self.only_hybrid = only_hybrid

    def should_deactivate(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """Deactivate whenever active."""
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        """0: no waiting."""
        return 0

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """Never."""
        return False

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        """No rebalancing (there is no activation)."""
        return False

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        """Nothing to update."""


@register_policy("fixed_ratio")
class FixedRatioPolicy:
    """``default`` with a fixed ratio and a pure gap check (no cost/benefit gate)."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False) -> None:
        _check_ratio(deactivate_ratio)
        self.deactivate_ratio = 1.0 if only_hybrid else deactivate_ratio
        self.only_hybrid = only_hybrid

    def should_deactivate(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """Deactivate whenever active."""
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        """``int(deactivate_ratio × step_required_samples)``."""
        return int(ctx.step_required_samples * self.deactivate_ratio)

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """Activate while the surplus is below the deactivate threshold."""
        if self.only_hybrid:
            return True
        surplus = ctx.total_generated_samples - ctx.expected_samples
        return surplus < self.deactivate_ratio * ctx.step_required_samples

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        """Always rebalance after activating."""
        return True

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        """The ratio is fixed."""
