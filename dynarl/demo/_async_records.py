"""What an asynchronous (hybrid) reference run is configured with and reports.

:class:`AsyncConfig` (the pipeline: devices, batch, staleness bound, queue, hybrid
policy), :class:`AsyncStepReport` (one training step: rewards, the weight versions of
every token trained on, timings, the ``dynamic_resource/*`` metrics of the step's sync
cycle), :class:`AsyncRunResult` (a run: steps, wall time, throughput, staleness, moves).
Pure data; runs anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["AsyncConfig", "AsyncRunResult", "AsyncStepReport"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AsyncConfig:
    """The asynchronous GRPO pipeline of a reference job."""

    num_devices: int = 2
    """Devices (worker processes): standalone rollout first, then the trainer's."""
    num_standalone_devices: int = 1
    """Devices that only generate (the others train and host the hybrid replicas)."""
    num_steps: int = 6
    """Training steps (weight versions) of a run."""
    num_groups: int = 4
    """Prompt groups per training step (the batch: ``num_groups × group_size`` samples)."""
    max_staleness: int = 1
    """A sample trains at version v only if every token was generated at v - this or later."""
    queue_batches: float = 2.0
    """The message queue's bound, in batches: samples buffered plus in generation."""
    concurrent_samples_per_replica: int = 16
    """s: turns one rollout engine is given at a time."""
    hybrid: bool = True
    """Trainer devices serve as hybrid rollout replicas (False: standalone-only run)."""
    policy: str = "default"
    """The hybrid policy (``dynarl.sched.build_policy`` name)."""
    deactivate_ratio: float = 0.3
    """The policy's initial deactivate ratio."""
    enable_rebalance: bool = True
    """Redistribute in-flight requests over every engine after an activation."""
    staleness_threshold: float = 0.1
    """verl's buffer headroom ratio (the policy context's ``buffer_samples``)."""
    item_timeout_s: float = 120.0
    """Longest wait for any generation to finish before the run fails, seconds."""

    def __post_init__(self) -> None:
        if not 0 < self.num_standalone_devices < self.num_devices:
            raise ValueError("AsyncConfig needs 0 < num_standalone_devices < num_devices")
        for name in ("num_steps", "num_groups", "concurrent_samples_per_replica"):
            if getattr(self, name) < 1:
                raise ValueError(f"AsyncConfig.{name} must be >= 1")
        if self.max_staleness < 0:
            raise ValueError(f"AsyncConfig.max_staleness must be >= 0, got {self.max_staleness}")
        if self.queue_batches < 1.0:
            raise ValueError(f"AsyncConfig.queue_batches must be >= 1, got {self.queue_batches}")
        if not 0.0 <= self.deactivate_ratio <= 1.0 or self.staleness_threshold < 0:
            raise ValueError("AsyncConfig: deactivate_ratio in [0, 1], staleness_threshold >= 0")
        if self.item_timeout_s <= 0:
            raise ValueError("AsyncConfig.item_timeout_s must be > 0")

    def queue_samples(self, group_size: int) -> int:
        """The message queue's capacity in samples (at least one batch)."""
        batch = self.num_groups * group_size
        return max(batch, math.ceil(self.queue_batches * batch))

    @property
    def label(self) -> str:
        """``hybrid`` or ``standalone-only``."""
        return "hybrid" if self.hybrid else "standalone-only"


@dataclass(frozen=True, kw_only=True, slots=True)
class AsyncStepReport:
    """One training step of an asynchronous run."""

    step: int
    """Step index (0-based)."""
    trainer_version: int
    """Weight version the step updated from (the staleness reference)."""
    version: int
    """Weight version after the step."""
    mean_reward: float
    """Mean reward of the batch."""
    rewards: tuple[float, ...]
    """Reward of every sample of the batch, in update order."""
    loss: float
    """Training loss."""
    kl: float
    """KL to the reference policy."""
    sample_ids: tuple[str, ...]
    """Samples of the batch, in update order."""
    versions: tuple[str, ...]
    """Per sample: the weight version of every generated token (run-length text)."""
    resumed: tuple[int, ...]
    """Per sample: times its generation was aborted and resumed."""
    began_s: float
    """Seconds since the run's start at which the step began."""
    wall_s: float
    """Seconds of the whole step (waits, update, syncs, switches)."""
    wait_s: float
    """Waiting for the batch after any deactivation, seconds."""
    update_s: float
    """Learning and the optimizer step, seconds (training compute)."""
    sync_s: float
    """Weight sync to the standalone engines, seconds."""
    deactivate_s: float
    """Deactivating the hybrid replicas, seconds."""
    wait_for_samples_s: float
    """Waiting for the policy's deactivate threshold (hybrid rollout time), seconds."""
    activate_s: float
    """Syncing and activating the hybrid replicas, seconds."""
    hybrid_active: bool
    """Hybrid replicas generating after the step."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The step's ``dynamic_resource/*`` metrics."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AsyncRunResult:
    """One asynchronous run."""

    label: str
    """``hybrid`` or ``standalone-only``."""
    config: AsyncConfig
    """Its pipeline."""
    steps: tuple[AsyncStepReport, ...]
    """Per-step reports."""
    wall_s: float
    """Seconds from the start of the pipeline to the end of the last step."""
    staleness: dict[str, float]
    """The staleness gate's summary (``StalenessStats.summary``)."""
    activations: int
    """Hybrid activations."""
    deactivations: int
    """Hybrid deactivations."""
    aborted: tuple[tuple[str, int, int], ...]
    """(request id, tokens generated so far, trainer version) of every request aborted on
    a hybrid replica at a deactivation and resumed on a standalone engine."""
    rebalanced: int
    """Requests aborted and re-dispatched by rebalances."""
    replica_log: tuple[tuple[str, int], ...]
    """Hybrid replica operations in order, with the trainer's version."""
    timeline: tuple[tuple[float, dict[str, int]], ...]
    """(seconds since the start, devices per component) at every change."""
    run_dir: str
    """Where its ledger and worker logs are."""

    @property
    def num_samples(self) -> int:
        """Samples trained on."""
        return sum(len(s.rewards) for s in self.steps)

    @property
    def throughput(self) -> float:
        """Samples trained per second of wall time."""
        return self.num_samples / self.wall_s if self.wall_s > 0 else 0.0

    def mean_metric(self, name: str) -> float:
        """Mean of a per-step metric over the run (0 without steps)."""
        values = [s.metrics.get(name, 0.0) for s in self.steps]
        return sum(values) / len(values) if values else 0.0
