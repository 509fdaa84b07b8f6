"""RebootMigration: save, stop, restart under the new resources, load.

The fallback for any component with neither a workload nor a P2P path. ``save`` writes a
checkpoint at a step boundary, ``stop`` ends the processes on the old resources,
``restart`` starts them on the new ones, ``load`` restores the checkpoint, ``commit`` makes
the new resources official. ``abort`` then ``rollback`` before commit brings the component
back on its old resources: nothing to do before ``stop``; after it, stop whatever was
restarted on the new resources, start again on the old ones and load the checkpoint.

Either side may be empty: a component that holds no resource yet has nothing to save or
stop and starts on the new ones from nothing (a rollback stops what it started); one that
goes down to no resource is stopped and started nowhere. A host that keeps state across
``stop`` (roles asleep in place) makes both a sleep and a wake.

The component is injected as a :class:`RebootHost` (the runtime implements it). Runs on
the coordinator's or manager's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from dynarl.migrate._protocol import Outcome, Step
from dynarl.migrate._step_runner import Action, StepHook, StepRunner, nothing
from dynarl.types import MigrationKind

__all__ = ["RebootHost", "RebootMigration"]


class RebootHost(Protocol):
    """A component that can be checkpointed and restarted elsewhere."""

    async def save(self) -> str:
        """Write a checkpoint at a step boundary; return a handle to it."""
        ...

    async def stop(self) -> None:
        """Stop the component's processes (idempotent)."""
        ...

    async def start(self, resources: Sequence[int]) -> None:
        """Start the component's processes on ``resources``."""
        ...

    async def load(self, checkpoint: str) -> None:
        """Restore the checkpoint ``checkpoint`` into the running processes."""
        ...


class RebootMigration(StepRunner):
    """Move a component from ``src_resources`` to ``dest_resources`` by restarting it.

    ``dest_resources`` may be given here or to :meth:`migrate` / :meth:`restart`.
    Raises ValueError when both sides are empty.
    """

    _PAUSED = (Step.SAVE, Step.COMMIT)

    def __init__(
        self,
        *,
        migration_id: str,
        src_resources: Sequence[int],
        host: RebootHost,
        dest_resources: Sequence[int] | None = None,
        lease_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        on_interrupt: Callable[[], Awaitable[None]] | None = None,
        on_step: StepHook | None = None,
    ) -> None:
        if not src_resources and dest_resources is not None and not dest_resources:
            raise ValueError("a reboot migration needs resources on one side at least")
        self.src_resources = tuple(src_resources)
        self.dest_resources: tuple[int, ...] | None = (
            tuple(dest_resources) if dest_resources is not None else None
        )
        self.checkpoint: str | None = None
        self._host, self._on_interrupt = host, on_interrupt
        super().__init__(
            migration_id, MigrationKind.REBOOT, lease_s=lease_s, clock=clock, on_step=on_step
        )

    def _action(self, step: Step) -> Action:
        actions: dict[Step, Action] = {
            Step.SAVE: self._save,
            Step.STOP: self._stop,
            Step.RESTART: self._restart,
            Step.LOAD: self._load,
            Step.COMMIT: nothing,
            Step.ABORT: nothing,
            Step.ROLLBACK: self._rollback,
        }
        return actions[step]

    async def save(self) -> Outcome:
        """Checkpoint the component."""
        return await self._run(Step.SAVE)

    async def _save(self) -> str:
        if self.src_resources:  # nothing runs: nothing to save
            self.checkpoint = await self._host.save()
        return ""

    async def stop(self) -> Outcome:
        """Stop it on the old resources."""
        return await self._run(Step.STOP)

    async def _stop(self) -> str:
        if self.src_resources:
            await self._host.stop()
        return ""

    async def restart(self, dest_resources: Sequence[int]) -> Outcome:
        """Start it on ``dest_resources`` (the first resources given are kept on replay)."""
        self._destination(dest_resources)
        return await self._run(Step.RESTART)

    def _destination(self, dest_resources: Sequence[int]) -> None:
        if self.dest_resources is None:
            if not self.src_resources and not dest_resources:
                raise ValueError("a reboot migration needs resources on one side at least")
            self.dest_resources = tuple(dest_resources)

    async def _restart(self) -> str:
        if self.dest_resources is None:
            return "no destination resources given"
        if self.dest_resources:
            await self._host.start(self.dest_resources)
        return ""

    async def load(self) -> Outcome:
        """Restore the checkpoint on the new resources."""
        return await self._run(Step.LOAD)

    async def _load(self) -> str:
        if self.checkpoint is not None and self.dest_resources:
            await self._host.load(self.checkpoint)
        return ""

    async def _rollback(self) -> str:
        if self._state.outcome(Step.STOP) is None:
            return ""  # never stopped: it still runs on the old resources
        await self._host.stop()
        if self.src_resources:
            await self._host.start(self.src_resources)
            if self.checkpoint is not None:
                await self._host.load(self.checkpoint)
        return ""

    async def interrupt(self) -> None:
        """Wait for a step boundary (the injected hook, if any)."""
        if self._on_interrupt is not None:
            await self._on_interrupt()

    async def migrate(self, dest_resources: Sequence[int]) -> Outcome:
        """Save, stop, restart on ``dest_resources``, load, commit; on a failure, abort and
        roll back (returns the rollback outcome). Raises ValueError when both sides are
        empty."""
        self._destination(dest_resources)
        return await super().migrate(dest_resources)
