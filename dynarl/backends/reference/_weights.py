"""The reference trainer's state as ``dynarl.migrate`` layouts, and trainer → rollout
weight sync planned by the migrate planner.

* :func:`param_specs` / :func:`trainer_state_layout`: every parameter of
  :class:`~._gpt.ParallelGPT` with its Adam moments and step counter, placed over the
  trainer's devices (data parallel, replicated optimizer state). The P2P migration that
  grows or shrinks the trainer moves exactly this.
* :func:`sync_plan`: weight sync as a reshard whose *destination is a replicated layout*
  over the rollout devices (the parameters only). The planner sends each destination rank
  only what it lacks: a rollout engine on a device where a trainer rank lives (asleep
  while the trainer works) gets a local copy; one on another device receives the
  parameters over torch.distributed from a trainer rank (spread over the replicas).
  :func:`run_sync` executes one rank's part; :data:`WEIGHTS_SLOT` is where a trainer rank
  leaves the copy for the rollout engine of its own process.

Planning is pure; :func:`run_sync` runs on a worker's compute thread (collective over the
ranks that send or receive).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from dynarl.backends.reference._gpt import GPTConfig, param_layout
from dynarl.migrate import (
    ExecutorConfig,
    Layout,
    LayoutSpec,
    ParamSpec,
    ReshardPlan,
    Stage,
    TransferReport,
    build_group,
    execute_plan,
    plan_reshard,
    replicated_layout,
    trainer_layout,
)

__all__ = [
    "WEIGHTS_SLOT",
    "SyncResult",
    "param_specs",
    "run_sync",
    "sync_plan",
    "trainer_state_layout",
]

logger = logging.getLogger(__name__)

WEIGHTS_SLOT = "reference.weights"
"""Key of ``RoleContext.shared``: ``(version, full state dict)`` a colocated trainer rank
left for the rollout engine of its process."""


def param_specs(model: GPTConfig) -> list[ParamSpec]:
    """The model's parameters as migrate ``ParamSpec`` s, in registration order."""
    specs = []
    for shard in param_layout(model):
        name = shard.name
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            stage, index = Stage.LAYER, layer
        else:
            stage = Stage.FIRST if name in ("embedding.weight", "position.weight") else Stage.LAST
            index = None
        specs.append(
            ParamSpec(
                name=name,
                shape=shard.full_shape,
                tp_dim=shard.partition_dim,
                stage=stage,
                layer=index,
            )
        )
    return specs


def trainer_state_layout(model: GPTConfig, devices: Sequence[int]) -> Layout:
    """Parameters, Adam moments and step counters, data parallel over ``devices`` (TP 1,
    every rank a full replica). Raises ValueError for no or repeated devices."""
    if not devices:
        raise ValueError("a trainer layout needs at least one device")
    spec = LayoutSpec(ranks=tuple(devices), dp=len(devices))
    return trainer_layout(param_specs(model), spec)


def sync_plan(model: GPTConfig, trainer: Sequence[int], rollout: Sequence[int]) -> ReshardPlan:
    """Parameters from the trainer ranks to a replicated layout over ``rollout`` (pure).

    Raises ValueError when there is no trainer or no rollout device.
    """
    if not trainer or not rollout:
        raise ValueError("weight sync needs trainer and rollout devices")
    source = trainer_state_layout(model, trainer)
    params = param_specs(model)
    names = {p.name for p in params}
    target = replicated_layout(params, sorted(rollout))
    src = [s for s in source.shards if s.tensor in names]
    return plan_reshard(target.tensor_map(), src, list(target.shards))


def remote_ranks(plan: ReshardPlan) -> tuple[int, ...]:
    """Ranks that send or receive anything over the network in ``plan``, ascending."""
    ranks = {r for item in plan.items if not item.is_local for r in (item.src_rank, item.dst_rank)}
    return tuple(sorted(ranks))


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncResult:
    """What one rank did in a weight sync."""

    state: dict[str, torch.Tensor]
    """The full parameters this rank now holds for its rollout engine (empty: none)."""
    report: TransferReport | None
    """The executor's report (None when nothing crossed ranks here)."""


def run_sync(
    plan: ReshardPlan,
    *,
    model: GPTConfig,
    rank: int,
    store: object,
    tag: str,
    sources: Mapping[str, torch.Tensor] | None,
    timeout_s: float = 30.0,
) -> SyncResult:
    """This rank's part of ``plan``: ``sources`` are its full parameters when it is a
    trainer rank (None otherwise); returns the parameters it receives when it is a
    rollout rank. ``tag`` names the sync's group (unique in the job, the same on every
    rank). Raises MigrationError when a transfer or checksum fails."""
    dst_names = [s for s in plan.dst if s.rank == rank]
    state = {shard.tensor: torch.empty(_shape(model, shard.tensor)) for shard in dst_names}
    destinations = {shard: state[shard.tensor] for shard in dst_names}
    src = {s: sources[s.tensor] for s in plan.src if s.rank == rank} if sources else {}
    members = remote_ranks(plan)
    group = None
    if rank in members:
        group = build_group(
            store,  # type: ignore[arg-type]
            name=f"dynarl/wsync/{tag}/" + "-".join(map(str, members)),
            ranks=members,
            rank=rank,
            timeout=timedelta(seconds=timeout_s),
        )
    try:
        if not destinations and not src:
            return SyncResult(state={}, report=None)
        report = execute_plan(
            plan,
            rank=rank,
            group=group,
            sources=src,
            destinations=destinations,
            config=ExecutorConfig(timeout_s=timeout_s),
        )
    finally:
        if group is not None:
            group.close()
    return SyncResult(state=state, report=report)


def _shape(model: GPTConfig, name: str) -> tuple[int, ...]:
    for shard in param_layout(model):
        if shard.name == name:
            return shard.full_shape
    raise ValueError(f"no parameter {name!r}")
