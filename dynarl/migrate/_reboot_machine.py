"""RebootMigration: save, stop, restart under the new resources, load.

The fallback for any component with neither a workload nor a P2P path. ``save`` writes a
checkpoint at a step boundary, ``stop`` ends the processes on the old resources,
``restart`` starts them on the new ones, ``load`` restores the checkpoint, ``commit`` makes
the new resources official. ``abort`` then ``rollback`` before commit brings the component
back on its old resources: nothing to do before ``stop``; after it, stop whatever was
restarted on the new resources, start again on the old ones and load the checkpoint.

The component is injected as a :class:`RebootHost` (the runtime implements it). Runs on
the coordinator's or manager's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from dynarl.migrate._protocol import Outcome, Step, StepRunner
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
    """Move a component from ``src_resources`` to ``dest_resources`` by restarting it."""

    def __init__(
        self,
        *,
        migration_id: str,
        src_resources: Sequence[int],
        host: RebootHost,
        lease_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        on_interrupt: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if not src_resources:
            raise ValueError("a reboot migration needs the component's current resources")
        self.src_resources = tuple(src_resources)
        self.dest_resources: tuple[int, ...] = ()
        self.checkpoint: str | None = None
        self._host, self._on_interrupt = host, on_interrupt
        super().__init__(migration_id, MigrationKind.REBOOT, lease_s=lease_s, clock=clock)

    async def save(self) -> Outcome:
        """Checkpoint the component."""
        return await self._step(Step.SAVE, self._save)

    async def _save(self) -> str:
        self.checkpoint = await self._host.save()
        return ""

    async def stop(self) -> Outcome:
        """Stop it on the old resources."""
        return await self._step(Step.STOP, self._stop)

    async def _stop(self) -> str:
        await self._host.stop()
        return ""

    async def restart(self, dest_resources: Sequence[int]) -> Outcome:
        """Start it on ``dest_resources`` (the first call's resources are kept on replay)."""
        if not self.dest_resources:
            self.dest_resources = tuple(dest_resources)
        return await self._step(Step.RESTART, self._restart)

    async def _restart(self) -> str:
        await self._host.start(self.dest_resources)
        return ""

    async def load(self) -> Outcome:
        """Restore the checkpoint on the new resources."""
        return await self._step(Step.LOAD, self._load)

    async def _load(self) -> str:
        assert self.checkpoint is not None
        await self._host.load(self.checkpoint)
        return ""

    async def commit(self) -> Outcome:
        """The new resources are the component's."""
        return await self._step(Step.COMMIT, self._nothing)

    async def abort(self, reason: str = "aborted") -> Outcome:
        """Stop before commit; ``rollback`` restores the old resources."""
        return await self._step(Step.ABORT, self._nothing)

    async def rollback(self) -> Outcome:
        """Bring the component back on its old resources from the checkpoint."""
        return await self._step(Step.ROLLBACK, self._rollback)

    async def _rollback(self) -> str:
        if self._state.outcome(Step.STOP) is None:
            return ""  # never stopped: it still runs on the old resources
        await self._host.stop()
        await self._host.start(self.src_resources)
        if self.checkpoint is not None:
            await self._host.load(self.checkpoint)
        return ""

    async def _nothing(self) -> str:
        return ""

    async def interrupt(self) -> None:
        """Wait for a step boundary (the injected hook, if any)."""
        if self._on_interrupt is not None:
            await self._on_interrupt()

    async def migrate(self, dest_resources: Sequence[int]) -> Outcome:
        """Save, stop, restart on ``dest_resources``, load, commit; on a failure, abort and
        roll back (returns the rollback outcome)."""
        steps: tuple[Callable[[], Awaitable[Outcome]], ...] = (
            self.save,
            self.stop,
            lambda: self.restart(dest_resources),
            self.load,
            self.commit,
        )
        for step in steps:
            outcome = await step()
            if not outcome.ok:
                return await self.cancel(outcome.detail)
        return outcome

    async def cancel(self, reason: str) -> Outcome:
        """Abort and roll back; returns the rollback outcome."""
        await self.abort(reason)
        return await self.rollback()
