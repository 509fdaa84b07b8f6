"""StepRunner: the one place the steps of a migration kind are sequenced.

The forward steps of the kind in order up to commit (:meth:`StepRunner.run_to_commit`),
then :meth:`~StepRunner.commit` or :meth:`~StepRunner.cancel` (abort, then rollback);
:meth:`~StepRunner.migrate` is the three in one. Each asynchronous executor
(:mod:`._drain`, :mod:`._reboot_machine`, :mod:`._p2p_group`) builds on it and supplies
only the action of each step, the I/O of that step over its injected host. A runtime
drives an executor through the :class:`Migration` surface and never runs a step by name.

Time comes from the injected ``clock`` (a callable returning seconds): the lease (see
:mod:`._protocol`), and the spans of the steps :attr:`StepRunner.pause_s` is measured
from. Runs on the caller's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from dynarl.migrate._protocol import MigrationState, Outcome, Step, new_migration, run_step
from dynarl.types import MigrationKind

__all__ = ["Action", "Migration", "StepHook", "StepRunner", "nothing"]

logger = logging.getLogger(__name__)


class Migration(Protocol):
    """What a runtime drives for every kind of migration (runs on the caller's loop).

    The coordinator's two-phase protocol: :meth:`run_to_commit` on every participant,
    then :meth:`commit` on all, or :meth:`cancel` on all; :meth:`migrate` is the whole
    sequence for a lone migration.
    """

    @property
    def migration_id(self) -> str:
        """Unique id; commands repeated under it are answered from the log."""
        ...

    @property
    def state(self) -> MigrationState:
        """The current state."""
        ...

    @property
    def pause_s(self) -> float:
        """Seconds the component was paused, on the migration's clock (0 until known)."""
        ...

    async def interrupt(self) -> None:
        """Reach a safe boundary (end of a training step, a query or batch boundary)."""
        ...

    async def run_to_commit(self) -> Outcome | None:
        """Run the forward steps before commit, in order; the first outcome that is not
        ok (the migration must then be cancelled), or None."""
        ...

    async def commit(self) -> Outcome:
        """Commit: the devices change hands. Returns the commit outcome."""
        ...

    async def migrate(self, dest_resources: Sequence[int]) -> Outcome:
        """Run the forward steps to commit onto ``dest_resources``; on a failure, abort
        and roll back. Returns the commit outcome or the rollback outcome."""
        ...

    async def cancel(self, reason: str) -> Outcome:
        """Abort (if not committed) and roll back; the previous allocation stays.
        Returns the rollback outcome."""
        ...


Action = Callable[[], Awaitable[str]]
"""The I/O of one step: "" on success, else why it failed (an exception fails it too)."""

StepHook = Callable[[Step], Awaitable[object]]
"""Called at the start of every forward step, before its I/O (a runtime's fault seam)."""


async def nothing() -> str:
    """A step with no side effect."""
    return ""


class StepRunner:
    """The sequencing shared by the asynchronous executors (see the module docstring).

    A subclass gives :meth:`_action` (the I/O of each step) and :attr:`_PAUSED` (the step
    the component's pause starts with and the one it ends with on commit; a rollback ends
    it too). ``clock`` is the job clock the lease and the step spans are measured on;
    ``on_step`` runs at the start of every forward step, and the lease is checked again
    after it, so a hook that outlasts the lease fails its step with ``lease expired``.
    """

    _PAUSED: tuple[Step, Step]

    def __init__(
        self,
        migration_id: str,
        kind: MigrationKind,
        *,
        lease_s: float,
        clock: Callable[[], float],
        on_step: StepHook | None = None,
    ) -> None:
        self._clock, self._on_step = clock, on_step
        self._state = new_migration(migration_id, kind, now=clock(), lease_s=lease_s)
        self._spans: dict[Step, tuple[float, float]] = {}

    @property
    def migration_id(self) -> str:
        """Unique id of the migration."""
        return self._state.migration_id

    @property
    def state(self) -> MigrationState:
        """Where the migration stands."""
        return self._state

    @property
    def spans(self) -> Mapping[Step, tuple[float, float]]:
        """Start and end, on the clock, of every step that ran (not of a replay or a
        refusal)."""
        return dict(self._spans)

    @property
    def pause_s(self) -> float:
        """Seconds from the start of the step that pauses the component to the end of
        the one that resumes it (on commit) or of the rollback; 0 until then."""
        first, last = self._PAUSED
        if first not in self._spans:
            return 0.0
        for end in (last, Step.ROLLBACK):
            if self._state.succeeded(end) and end in self._spans:
                return self._spans[end][1] - self._spans[first][0]
        return 0.0

    def _action(self, step: Step) -> Action:
        """The I/O of ``step`` (every forward step of the kind, abort and rollback)."""
        raise NotImplementedError

    async def _step(self, step: Step, action: Action) -> Outcome:
        hook = self._on_step if step in self._state.steps else None
        began: list[float] = []

        async def act() -> str:
            began.append(self._clock())
            if hook is not None:
                await hook(step)
                if self._clock() > self._state.deadline:
                    return "lease expired"
            return await action()

        self._state, outcome = await run_step(self._state, step, now=self._clock(), action=act)
        if began:
            self._spans[step] = (began[0], self._clock())
        return outcome

    async def _run(self, step: Step) -> Outcome:
        return await self._step(step, self._action(step))

    async def interrupt(self) -> None:
        """Reach a safe boundary (nothing to wait for unless a kind says otherwise)."""

    async def run_to_commit(self) -> Outcome | None:
        """Run every forward step before commit, in order (one already run answers from
        the log); the first outcome that is not ok, or None when all succeeded."""
        for step in self._state.steps[:-1]:
            outcome = await self._run(step)
            if not outcome.ok:
                return outcome
        return None

    async def commit(self) -> Outcome:
        """The devices change hands (refused unless every forward step succeeded)."""
        return await self._run(Step.COMMIT)

    async def abort(self, reason: str = "aborted") -> Outcome:
        """Stop before commit; :meth:`rollback` then restores the previous allocation."""
        logger.info("migration %s aborting: %s", self.migration_id, reason)
        return await self._run(Step.ABORT)

    async def rollback(self) -> Outcome:
        """Restore the previous allocation (after an abort or a failed step)."""
        return await self._run(Step.ROLLBACK)

    async def cancel(self, reason: str) -> Outcome:
        """Abort and roll back; returns the rollback outcome."""
        await self.abort(reason)
        return await self.rollback()

    async def migrate(self, dest_resources: Sequence[int]) -> Outcome:
        """Every forward step, then commit; on a failure (commit included), abort and roll
        back. Returns the commit or the rollback outcome. ``dest_resources`` is checked
        by each kind."""
        failed = await self.run_to_commit()
        if failed is None:
            committed = await self.commit()
            if committed.ok:
                return committed
            failed = committed
        return await self.cancel(failed.detail)
