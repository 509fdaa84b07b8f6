"""P2PGroupMigration: a P2P reshard as its coordinator runs it, over every rank at once.

Every rank of the old and the new layout runs its own :class:`~dynarl.migrate.P2PMigration`;
this machine sequences them: ``prepare → transfer → verify`` on every rank, then ``commit``
on every rank, or ``abort → rollback`` on every rank, under one lease and one log of its
own. A forward step (commit included) fails when any rank fails it. ``abort`` and
``rollback`` restore the old layout, so they fail only when a rank of the old layout
fails them: a joining rank that is gone or unresponsive holds none of it (its own lease
watchdog rolls it back), and its failure is logged. After a commit or a rollback the
migration group is closed on every rank.

The ranks are injected as a :class:`P2PHost` (the runtime sends one message per rank and
step). No torch here. Runs on the coordinator's event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from dynarl.migrate._protocol import Outcome, Step
from dynarl.migrate._step_runner import Action, StepHook, StepRunner
from dynarl.types import MigrationKind

__all__ = ["P2PGroupMigration", "P2PHost"]

logger = logging.getLogger(__name__)


class P2PHost(Protocol):
    """Every rank of the old and the new layout, as the coordinator reaches them."""

    async def step(self, step: Step) -> Mapping[int, str]:
        """Run ``step`` on every rank; the ranks that failed it, with why (empty: none)."""
        ...

    async def close(self) -> None:
        """Drop the migration group on every rank (idempotent; failures are logged)."""
        ...


class P2PGroupMigration(StepRunner):
    """Reshard a component from the ranks ``src`` to the ranks ``dst`` (module docstring).

    Raises ValueError when either side is empty (that is a reboot in place).
    """

    _PAUSED = (Step.PREPARE, Step.COMMIT)

    def __init__(
        self,
        *,
        migration_id: str,
        src: Sequence[int],
        dst: Sequence[int],
        host: P2PHost,
        lease_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        on_step: StepHook | None = None,
    ) -> None:
        if not src or not dst:
            raise ValueError("a P2P migration needs ranks in the old and in the new layout")
        self.src, self.dst = tuple(src), tuple(dst)
        self._host = host
        super().__init__(
            migration_id, MigrationKind.P2P, lease_s=lease_s, clock=clock, on_step=on_step
        )

    def _action(self, step: Step) -> Action:
        needed = self.src if step in (Step.ABORT, Step.ROLLBACK) else None

        async def on_every_rank() -> str:
            failed = dict(await self._host.step(step))
            moot = {r: d for r, d in failed.items() if needed is not None and r not in needed}
            if moot:
                logger.warning(
                    "%s: %s failed on ranks holding nothing of the old layout (their "
                    "watchdogs roll back): %s",
                    self.migration_id,
                    step,
                    _details(moot),
                )
            return _details({r: d for r, d in failed.items() if r not in moot})

        return on_every_rank

    async def commit(self) -> Outcome:
        """Commit on every rank; the migration group is closed once it committed."""
        outcome = await super().commit()
        if outcome.ok:
            await self._host.close()
        return outcome

    async def cancel(self, reason: str) -> Outcome:
        """Abort and roll back on every rank, then close the migration group; returns the
        rollback outcome."""
        outcome = await super().cancel(reason)
        await self._host.close()
        return outcome

    async def migrate(self, dest_resources: Sequence[int]) -> Outcome:
        """Every step to commit; on a failure, abort and roll back. Raises ValueError when
        ``dest_resources`` are not the new layout's ranks."""
        if sorted(dest_resources) != sorted(self.dst):
            raise ValueError(f"dest_resources {sorted(dest_resources)} != ranks {sorted(self.dst)}")
        return await super().migrate(dest_resources)


def _details(failed: Mapping[int, str]) -> str:
    return "; ".join(f"rank {rank}: {detail}" for rank, detail in sorted(failed.items()))
