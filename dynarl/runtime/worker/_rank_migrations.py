"""One rank's side of P2P migrations: the migrate ``P2PMigration`` driven step by step.

The coordinator sends every rank of the old and new layouts the same :class:`Reshard`
steps. ``prepare`` creates the rank's :class:`~dynarl.migrate.P2PMigration` (adopting a
fresh, inactive role instance on a rank that joins) and arms a watchdog: if the migration
has neither committed nor rolled back when its lease lapses (plus a grace), the rank aborts
and rolls back on its own. Steps run on the worker's compute thread, so they never overlap
the role's own compute; a repeated step answers from the migration's log. Which step
comes next is the coordinator's machine's to say (:class:`~dynarl.migrate.P2PGroupMigration`);
this module only runs the step each message names.

The lease, the watchdog's wait and the steps' durations read the injected
:class:`~dynarl.sched.Clock` (the monotonic clock by default); the collectives' own
deadlines (``timeout_s``) bound real I/O and stay with torch.distributed. Runs on the
worker's event loop.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dynarl.migrate import ExecutorConfig, Outcome, P2PConfig, P2PMigration
from dynarl.runtime._worker_protocol import Activate, Reshard, StepResult
from dynarl.runtime.worker._host import RoleHost
from dynarl.runtime.worker._role import ComputeThread, Reshardable
from dynarl.sched import Clock, MonotonicClock

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["RankMigrations"]

logger = logging.getLogger(__name__)

_GRACE_S = 5.0


@dataclass(slots=True)
class _Entry:
    migration: P2PMigration
    command: Reshard
    joined: bool
    watchdog: asyncio.Task[None] | None = None
    ended: bool = False


class RankMigrations:
    """The P2P migrations this rank takes part in (see the module docstring)."""

    def __init__(
        self,
        *,
        device: int,
        host: RoleHost,
        compute: ComputeThread,
        store: Callable[[], Store],
        group: asyncio.TaskGroup,
        timeout_s: float = 20.0,
        clock: Clock | None = None,
    ) -> None:
        self.device = device
        self._host, self._compute, self._store, self._group = host, compute, store, group
        self._timeout_s = timeout_s
        self._clock = clock if clock is not None else MonotonicClock()
        self._entries: dict[str, _Entry] = {}

    async def step(self, command: Reshard) -> StepResult:
        """Run one step; never raises for a failed step (the result says why)."""
        began = self._clock.now()
        try:
            ok, detail, moved = await self._step(command)
        except Exception as exc:  # the command's boundary: a failed step, reported
            logger.warning("rank %d: %s %s failed: %r", self.device, command.step, command, exc)
            return StepResult(device=self.device, ok=False, detail=f"{type(exc).__name__}: {exc}")
        return StepResult(
            device=self.device,
            ok=ok,
            detail=detail,
            bytes_moved=moved,
            seconds=self._clock.now() - began,
        )

    async def _step(self, command: Reshard) -> tuple[bool, str, int]:
        mid = command.migration_id
        entry = self._entries.get(mid)
        if command.step == "prepare":
            entry = entry or await self._create(command)
            return (*_result(await self._compute.run(entry.migration.prepare)), 0)
        if entry is None:
            ok = command.step in ("abort", "rollback", "close")
            return ok, "" if ok else f"unknown migration {mid!r} on rank {self.device}", 0
        migration = entry.migration
        match command.step:
            case "transfer":
                outcome = await self._compute.run(migration.transfer)
                report = migration.report
                return (*_result(outcome), report.bytes_sent if report is not None else 0)
            case "verify":
                return (*_result(await self._compute.run(migration.verify)), 0)
            case "commit":
                return (*_result(await self._commit(entry)), 0)
            case "abort":
                return (*_result(await self._compute.run(migration.abort, "coordinator")), 0)
            case "rollback":
                return (*_result(await self._undo(entry, migration.rollback)), 0)
            case "close":
                await self._compute.run(migration.close)
                self._end(entry)
                del self._entries[mid], entry, migration
                gc.collect()  # its groups and buffers often hang on a reference cycle
                return True, "", 0
        return False, f"unknown step {command.step!r}", 0

    async def _create(self, command: Reshard) -> _Entry:
        joined = not self._host.hosts(command.component)
        if joined:
            role = await self._host.adopt(
                Activate(
                    component=command.component,
                    role=command.role,
                    devices=command.dst,
                    options=command.options,
                    manager=command.manager,
                    epoch=command.epoch,
                    fresh=False,
                )
            )
        else:
            role = self._host.role(command.component)
        if not isinstance(role, Reshardable):
            raise TypeError(f"{command.component} role is not Reshardable (no P2P migration)")
        src = await self._compute.run(role.layout, command.src)
        dst = await self._compute.run(role.layout, command.dst)
        config = P2PConfig(
            lease_s=command.lease_s,
            group_timeout_s=self._timeout_s,
            executor=ExecutorConfig(timeout_s=self._timeout_s),
        )
        store = await self._compute.run(self._store)  # connecting may block: not on the loop
        migration = P2PMigration(
            migration_id=command.migration_id,
            src=src,
            dst=dst,
            rank=self.device,
            store=store,
            epoch=command.epoch,
            trainer=role,
            config=config,
            clock=self._clock.now,
        )
        entry = _Entry(migration=migration, command=command, joined=joined)
        entry.watchdog = self._group.create_task(self._watch(entry))
        self._entries[command.migration_id] = entry
        return entry

    async def _commit(self, entry: _Entry) -> Outcome:
        outcome = await self._compute.run(entry.migration.commit)
        if not outcome.ok:
            return outcome
        command = entry.command
        self._end(entry)
        if self.device not in command.dst:
            await self._host.deactivate(command.component, keep=False)
            return outcome
        self._host.context(command.component).devices = command.dst
        if entry.joined:
            await self._host.activate(
                Activate(
                    component=command.component,
                    role=command.role,
                    devices=command.dst,
                    options=command.options,
                    manager=command.manager,
                    epoch=command.epoch,
                    fresh=False,
                )
            )
        return outcome

    async def _undo(self, entry: _Entry, undo: Callable[[], Outcome]) -> Outcome:
        """Run ``undo`` (a rollback) on the compute thread; once it succeeded the
        migration has ended here, and a joining rank drops the role it adopted."""
        outcome = await self._compute.run(undo)
        if outcome.ok:
            self._end(entry)
            if entry.joined:
                await self._host.deactivate(entry.command.component, keep=False)
        return outcome

    def _end(self, entry: _Entry) -> None:
        entry.ended = True
        if entry.watchdog is not None and entry.watchdog is not asyncio.current_task():
            entry.watchdog.cancel()

    async def _watch(self, entry: _Entry) -> None:
        await self._clock.sleep(entry.command.lease_s + _GRACE_S)
        if entry.ended or entry.migration.state.committed:
            return
        logger.warning(
            "rank %d: lease of migration %s lapsed: rolling back on its own",
            self.device,
            entry.migration.migration_id,
        )
        try:
            await self._undo(entry, functools.partial(entry.migration.abandon, "lease lapsed"))
        except Exception:  # the watchdog's boundary: logged, the coordinator retries
            logger.exception("rank %d: self-rollback failed", self.device)

    def close(self) -> None:
        """Stop every watchdog (agent shutdown)."""
        for entry in self._entries.values():
            self._end(entry)


def _result(outcome: Outcome) -> tuple[bool, str]:
    return outcome.ok, outcome.detail
