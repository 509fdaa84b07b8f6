"""The ``dynamic_resource/*`` metrics of hybrid scheduling, as verl defines them.

Per sync cycle (between two weight syncs):

- ``train_resource_utilization`` = Σ compute_i / Σ alloc_i over the cycle's micro
  fit-steps (summed first, one ratio); compute_i sums the timing keys ``reward``,
  ``old_log_prob``, ``ref``, ``values``, ``adv``, ``update_critic``, ``update_actor``
  (missing keys count 0); alloc_i is the step's wall time, sync and activation included.
- ``rollout_resource_utilization`` = Σ (t_{k+1} − t_k)·min(cap_k, active_k) /
  Σ (t_{k+1} − t_k)·cap_k over an event history, cap_k = min(servers_k × s, maxReq),
  each interval with its own capacity; 0 with no capacity-time. A placeholder capacity
  of 0 recorded before the real capacity is known is corrected when it becomes known.
- ``resource_utilization`` = ((1 − x)·a·U_train + (x·a + b)·U_rollout) / (a + b), with
  x = clip(wait / step, 0, 1) the hybrid devices' rollout share (0 when they never
  switched), a hybrid and b standalone devices.
- ``mq_size``: the message-queue size after the cycle's last fit-step (a snapshot).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "TRAIN_COMPUTE_KEYS",
    "DynamicResourceMetrics",
    "RolloutUtilization",
    "resource_utilization",
    "rollout_capacity",
    "rollout_resource_utilization",
    "train_compute_time",
    "train_resource_utilization",
]

TRAIN_COMPUTE_KEYS = (
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
)
"""Timing keys that count as training-GPU compute."""


def train_compute_time(timing: Mapping[str, float]) -> float:
    """compute_i: the sum of the training-compute timing keys (missing keys are 0)."""
    return sum(float(timing.get(key, 0.0)) for key in TRAIN_COMPUTE_KEYS)


def train_resource_utilization(compute_s: Sequence[float], allocated_s: Sequence[float]) -> float:
    """Σ compute / Σ allocated (0 when nothing was allocated)."""
    allocated = sum(allocated_s)
    return sum(compute_s) / allocated if allocated > 0 else 0.0


def rollout_capacity(servers: int, samples_per_replica: int, max_required_samples: int) -> int:
    """cap = min(servers × s, maxReq)."""
    return min(servers * samples_per_replica, max_required_samples)


def rollout_resource_utilization(history: Sequence[tuple[float, int, int]]) -> float:
    """Utilization from ``(t_k, active_k, cap_k)`` events, the last one closing the window."""
    used = total = 0.0
    for (t0, active, cap), (t1, _, _) in itertools.pairwise(history):
        if cap <= 0:
            continue
        span = t1 - t0
        used += span * min(cap, active)
        total += span * cap
    return used / total if total > 0 else 0.0


def resource_utilization(
    *,
    hybrid_devices: int,
    standalone_devices: int,
    train_utilization: float,
    rollout_utilization: float,
    wait_s: float,
    step_s: float,
) -> float:
    """Cluster-wide utilization of a cycle (see the module docstring)."""
    a, b = hybrid_devices, standalone_devices
    if a + b == 0:
        return 0.0
    x = min(max(wait_s / step_s, 0.0), 1.0) if step_s > 0 else 0.0
    return ((1 - x) * a * train_utilization + (x * a + b) * rollout_utilization) / (a + b)


@dataclass(slots=True)
class RolloutUtilization:
    """The rollouter's event history of (time, active tasks, capacity) for one window."""

    history: list[tuple[float, int, int]] = field(default_factory=list)
    known: bool = False

    def record(self, time: float, active: int, capacity: int | None) -> None:
        """Note the active count and capacity from ``time`` on (None: not known yet).

        When the capacity first becomes known, the placeholder 0 recorded before it is
        replaced by it.
        """
        if capacity is not None and not self.known:
            self.history = [(t, a, capacity) for t, a, _ in self.history]
            self.known = True
        self.history.append((time, active, capacity if capacity is not None else 0))

    def close(self, time: float) -> float:
        """End the window at ``time`` (the weight sync): its utilization; a new one starts."""
        if not self.history:
            return 0.0
        _, active, cap = self.history[-1]
        closed = [*self.history, (time, active, cap)]
        self.history = [(time, active, cap)]
        return rollout_resource_utilization(closed)


@dataclass(slots=True)
class DynamicResourceMetrics:
    """Aggregates a sync cycle's micro fit-steps into the ``dynamic_resource/*`` metrics."""

    hybrid_devices: int
    """a: trainer devices that can switch to rollout."""
    standalone_devices: int
    """b: dedicated rollout devices."""
    compute_s: list[float] = field(default_factory=list)
    allocated_s: list[float] = field(default_factory=list)
    wait_s: float = 0.0
    step_s: float = 0.0
    mq_size: int = 0

    def add_step(
        self,
        *,
        timing: Mapping[str, float],
        allocated_s: float,
        step_s: float,
        wait_for_samples_s: float = 0.0,
        mq_size: int,
    ) -> None:
        """One micro fit-step's timings and the queue size right after it."""
        self.compute_s.append(train_compute_time(timing))
        self.allocated_s.append(allocated_s)
        self.wait_s += wait_for_samples_s
        self.step_s += step_s
        self.mq_size = mq_size

    def cycle(self, rollout_utilization: float) -> dict[str, float]:
        """The cycle's metrics (by their logged names); the aggregator starts over."""
        train = train_resource_utilization(self.compute_s, self.allocated_s)
        metrics = {
            "dynamic_resource/train_compute_time_s": sum(self.compute_s),
            "dynamic_resource/train_allocated_time_s": sum(self.allocated_s),
            "dynamic_resource/train_resource_utilization": train,
            "dynamic_resource/rollout_resource_utilization": rollout_utilization,
            "dynamic_resource/resource_utilization": resource_utilization(
                hybrid_devices=self.hybrid_devices,
                standalone_devices=self.standalone_devices,
                train_utilization=train,
                rollout_utilization=rollout_utilization,
                wait_s=self.wait_s,
                step_s=self.step_s,
            ),
            "dynamic_resource/mq_size": float(self.mq_size),
        }
        self.compute_s, self.allocated_s = [], []
        self.wait_s = self.step_s = 0.0
        return metrics
