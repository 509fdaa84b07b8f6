"""P2PMigration: create-before-destroy trainer reshard on one rank.

Every rank that holds state in the old or the new layout runs one :class:`P2PMigration`
with the same id, layouts and epoch. ``prepare`` plans the move, builds the migration group
over exactly the plan's ranks and (on new-layout ranks) the new layout's groups, and asks
the trainer to *allocate* the new state next to the old one; ``transfer`` runs the plan;
``verify`` compares per-shard checksums and agrees on the verdict over the migration group;
only ``commit`` makes the trainer switch to the new layout (and swap whatever process-wide
state its framework keeps) and free the old shards; ``close`` then drops the migration group.
``prepare`` leaves the old state alone, so it may run while training goes on: the pause is
``transfer``, ``verify`` and ``commit``. ``abort`` at any step before commit,
then ``rollback``, discards what was allocated: the old layout was never touched and
training goes on. Commands are idempotent per migration id.

In a job the coordinator's :class:`~dynarl.migrate._p2p_group.P2PGroupMigration` sequences
the steps and sends each to every rank, which runs the method of that step; alone,
``migrate`` runs them in order. The lease is measured on the injected ``clock``;
:attr:`P2PMigration.timings` profile this rank's compute with ``time.perf_counter`` and
are never compared with a lease.

The trainer is injected as a :class:`ShardedTrainer`; the Megatron one lives with the
caller (see :mod:`._megatron_layout` for the pieces). Methods block; they run in the rank's
trainer thread (``migrate`` hands them to a worker thread from the rank's event loop).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from dynarl.migrate._executor import ExecutorConfig, PlanExecutor, TransferReport
from dynarl.migrate._groups import CommGroup, LayoutGroups, build_group
from dynarl.migrate._layout import Layout
from dynarl.migrate._protocol import (
    MigrationState,
    Outcome,
    Step,
    begin,
    finish,
    new_migration,
    record_refusal,
)
from dynarl.migrate._region import Shard
from dynarl.migrate._reshard_plan import ReshardPlan, plan_reshard
from dynarl.types import MigrationKind

__all__ = ["P2PConfig", "P2PMigration", "ShardedTrainer"]

logger = logging.getLogger(__name__)


class ShardedTrainer(Protocol):
    """The trainer as a P2P migration sees it, on one rank."""

    def shard_views(self) -> Mapping[Shard, torch.Tensor]:
        """Views of this rank's shards of the current layout (empty when it holds none)."""
        ...

    def allocate(self, layout: Layout, groups: LayoutGroups | None) -> Mapping[Shard, torch.Tensor]:
        """Create this rank's state for ``layout`` next to the current one (model built on
        ``groups``, optimizer state) and return views of its shards; must not modify the
        current state. Touch the memory (zeros): first-touch page faults would otherwise
        land in the pause. ``groups`` is None on ranks outside the new layout (return {})."""
        ...

    def commit(self, layout: Layout) -> None:
        """Make the allocated state current, swap process-wide framework state, free the
        old state and its groups. Called only after every rank verified."""
        ...

    def discard(self, layout: Layout) -> None:
        """Free whatever :meth:`allocate` created for ``layout`` (idempotent)."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class P2PConfig:
    """Settings of one P2P migration."""

    lease_s: float = 120.0
    """Seconds from creation until forward steps are refused."""
    backend: str = "gloo"
    """``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors)."""
    group_timeout_s: float = 30.0
    """Deadline for building a group and for the verdict collective, seconds."""
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    """How the plan is executed (chunk size, timeouts, checksums)."""

    def __post_init__(self) -> None:
        if self.lease_s <= 0 or self.group_timeout_s <= 0:
            raise ValueError("P2PConfig.lease_s and group_timeout_s must be > 0")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"P2PConfig.backend must be 'gloo' or 'nccl', got {self.backend!r}")


class P2PMigration:
    """One rank's side of a create-before-destroy reshard from ``src`` to ``dst``.

    ``epoch`` names the new layout's groups (unique per layout change in the job);
    ``store`` is the job's store. The rank must hold state in ``src`` or ``dst``; raises
    ValueError otherwise or when ``dst`` has no LayoutSpec and contains this rank.
    """

    def __init__(
        self,
        *,
        migration_id: str,
        src: Layout,
        dst: Layout,
        rank: int,
        store: Store,
        epoch: int,
        trainer: ShardedTrainer,
        config: P2PConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_interrupt: Callable[[], Awaitable[None]] | None = None,
        plan: ReshardPlan | None = None,
    ) -> None:
        if rank not in src.ranks and rank not in dst.ranks:
            raise ValueError(f"rank {rank} holds no state in {src.name} or {dst.name}")
        if rank in dst.ranks and dst.spec is None:
            raise ValueError(f"destination layout {dst.name} has no LayoutSpec to build groups")
        self.config = config or P2PConfig()
        self.src, self.dst, self.rank, self.epoch = src, dst, rank, epoch
        self._store, self._trainer = store, trainer
        self._on_interrupt = on_interrupt
        self._clock = clock
        self._state = new_migration(
            migration_id, MigrationKind.P2P, now=clock(), lease_s=self.config.lease_s
        )
        self.plan = plan
        self.report: TransferReport | None = None
        self.timings: dict[str, float] = {}
        self._group: CommGroup | None = None
        self._groups: LayoutGroups | None = None
        self._executor: PlanExecutor | None = None

    @property
    def migration_id(self) -> str:
        """Unique id of the migration."""
        return self._state.migration_id

    @property
    def state(self) -> MigrationState:
        """Where this rank's side of the migration stands."""
        return self._state

    def _run(self, step: Step, action: Callable[[], str]) -> Outcome:
        start = begin(self._state, step, now=self._clock())
        if not start.run:
            assert start.outcome is not None
            self._state = record_refusal(self._state, start)
            return start.outcome
        began = time.perf_counter()
        try:
            detail = action()
        except Exception as exc:
            logger.warning(
                "migration %s: %s failed on rank %d: %s", self.migration_id, step, self.rank, exc
            )
            self._state = finish(self._state, step, ok=False, detail=f"{type(exc).__name__}: {exc}")
        else:
            self._state = finish(self._state, step, ok=not detail, detail=detail)
        self.timings[str(step)] = time.perf_counter() - began
        logger.info(
            "migration %s on rank %d: %s -> %s",
            self.migration_id,
            self.rank,
            step,
            self._state.phase,
        )
        outcome = self._state.outcome(step)
        assert outcome is not None
        return outcome

    def prepare(self) -> Outcome:
        """Plan, build the migration group and the new layout's groups, allocate."""
        return self._run(Step.PREPARE, self._prepare)

    def _prepare(self) -> str:
        began = time.perf_counter()
        if self.plan is None:
            self.plan = plan_reshard(self.dst.tensor_map(), self.src.shards, self.dst.shards)
        self.timings["plan_s"] = time.perf_counter() - began
        timeout = timedelta(seconds=self.config.group_timeout_s)
        name = f"dynarl/{self.epoch}/migrate/{self.migration_id}"
        self._group = build_group(
            self._store,
            name=name,
            ranks=self.plan.ranks,
            rank=self.rank,
            backend=self.config.backend,
            timeout=timeout,
        )
        build_s = self._group.build_s
        if self.rank in self.dst.ranks:
            assert self.dst.spec is not None
            self._groups = LayoutGroups.build(
                self._store,
                self.dst.spec,
                rank=self.rank,
                epoch=self.epoch,
                backend=self.config.backend,
                timeout=timeout,
            )
            build_s += self._groups.build_s
        self.timings["group_build_s"] = build_s
        began = time.perf_counter()
        destinations = self._trainer.allocate(self.dst, self._groups)
        self.timings["allocate_s"] = time.perf_counter() - began
        began = time.perf_counter()
        self._executor = PlanExecutor(
            self.plan, rank=self.rank, group=self._group, config=self.config.executor
        )
        self._executor.prepare(destinations, self._trainer.shard_views())
        self.timings["staging_s"] = time.perf_counter() - began
        return ""

    def transfer(self) -> Outcome:
        """Copy every destination shard from its sources (old state untouched)."""
        return self._run(Step.TRANSFER, self._transfer)

    def _transfer(self) -> str:
        assert self._executor is not None
        self.report = self._executor.run(self._trainer.shard_views())
        self.timings.update(
            copy_s=self.report.copy_s, wire_s=self.report.wire_s, checksum_s=self.report.checksum_s
        )
        return ""

    def verify(self) -> Outcome:
        """Agree over the migration group that every destination shard matched its sources."""
        return self._run(Step.VERIFY, self._verify)

    def _verify(self) -> str:
        assert self.report is not None and self._group is not None
        flag = torch.tensor([1 if self.report.verified else 0], dtype=torch.int32)
        if self.config.backend == "nccl":
            flag = flag.cuda()
        work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group.pg, async_op=True)
        assert work is not None
        work.wait(timedelta(seconds=self.config.group_timeout_s))
        if int(flag.item()) == 1:
            return ""
        mine = ", ".join(f"{s.tensor} {s.region}" for s in self.report.mismatched[:3])
        return f"checksum mismatch ({mine or 'on another rank'})"

    def commit(self) -> Outcome:
        """Switch the trainer to the new layout and free the old shards."""
        return self._run(Step.COMMIT, self._commit)

    def _commit(self) -> str:
        self._trainer.commit(self.dst)
        self._groups = None  # the trainer owns them now
        self._executor = None
        return ""

    def close(self) -> None:
        """Destroy the migration group (after commit, outside the pause; idempotent)."""
        self._close_group()

    def abort(self, reason: str = "aborted") -> Outcome:
        """Stop the migration before commit; ``rollback`` then frees what it allocated."""
        return self._run(Step.ABORT, lambda: self._aborted(reason))

    def _aborted(self, reason: str) -> str:
        logger.info("migration %s aborted on rank %d: %s", self.migration_id, self.rank, reason)
        return ""

    def rollback(self) -> Outcome:
        """Discard the new state and groups; the old layout keeps training."""
        return self._run(Step.ROLLBACK, self._rollback)

    def abandon(self, reason: str) -> Outcome:
        """Abort (if not committed) and roll back; the rollback outcome (blocks)."""
        self.abort(reason)
        return self.rollback()

    def _rollback(self) -> str:
        self._trainer.discard(self.dst)
        if self._groups is not None:
            self._groups.close()
            self._groups = None
        self._executor = None
        self._close_group()
        return ""

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    async def interrupt(self) -> None:
        """Wait for the trainer to reach a step boundary (the injected hook, if any)."""
        if self._on_interrupt is not None:
            await self._on_interrupt()

    async def migrate(self, dest_resources: Sequence[int]) -> Outcome:
        """Run prepare → transfer → verify → commit in a worker thread; on a failure,
        abort and roll back. Raises ValueError if ``dest_resources`` are not the new
        layout's ranks."""
        if sorted(dest_resources) != list(self.dst.ranks):
            raise ValueError(
                f"dest_resources {sorted(dest_resources)} != layout ranks {self.dst.ranks}"
            )
        forward = {
            Step.PREPARE: self.prepare,
            Step.TRANSFER: self.transfer,
            Step.VERIFY: self.verify,
            Step.COMMIT: self.commit,
        }
        for step in self._state.steps:
            outcome = await asyncio.to_thread(forward[step])
            if not outcome.ok:
                return await self.cancel(outcome.detail)
        await asyncio.to_thread(self.close)
        return outcome

    async def cancel(self, reason: str) -> Outcome:
        """Abort then roll back, in a worker thread; returns the rollback outcome."""
        return await asyncio.to_thread(self.abandon, reason)
