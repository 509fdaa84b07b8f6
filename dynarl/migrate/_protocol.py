"""The migration life cycle shared by all kinds: steps, outcomes, leases, idempotence.

Every migration has an id, a lease (a deadline on the job clock) and an ordered list of
forward steps ending in ``commit``, one sequence per :class:`~dynarl.types.MigrationKind`:

- P2P (trainer reshard): ``prepare → transfer → verify → commit``
- workload (rollout, inference, reward, tools): ``grow → stop_routing → drain →
  redispatch → release → commit``
- reboot: ``save → stop → restart → load → commit``

Before commit, ``abort`` may come at any step; ``rollback`` then restores the previous
allocation. Each command is idempotent per migration id: repeating it returns the outcome
recorded the first time and does nothing. A forward step after the lease's deadline fails
with reason ``lease expired`` and the migration must be rolled back.

:class:`MigrationState` and :func:`begin` / :func:`finish` are pure (no I/O, no clock);
the executors (:mod:`._p2p`, and through :mod:`._step_runner` the others) call
:func:`begin` before a side effect, perform it only when told to, and record it with
:func:`finish`; :func:`run_step` is the two around one asynchronous action.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from dynarl.types import MigrationKind

__all__ = [
    "KIND_STEPS",
    "MigrationState",
    "Outcome",
    "Start",
    "Step",
    "begin",
    "finish",
    "new_migration",
    "record_refusal",
    "run_step",
]

logger = logging.getLogger(__name__)


class Step(enum.StrEnum):
    """A command of the migration life cycle."""

    GROW = "grow"
    PREPARE = "prepare"
    TRANSFER = "transfer"
    VERIFY = "verify"
    STOP_ROUTING = "stop_routing"
    DRAIN = "drain"
    REDISPATCH = "redispatch"
    RELEASE = "release"
    SAVE = "save"
    STOP = "stop"
    RESTART = "restart"
    LOAD = "load"
    COMMIT = "commit"
    ABORT = "abort"
    ROLLBACK = "rollback"


KIND_STEPS: dict[MigrationKind, tuple[Step, ...]] = {
    MigrationKind.P2P: (Step.PREPARE, Step.TRANSFER, Step.VERIFY, Step.COMMIT),
    MigrationKind.WORKLOAD: (
        Step.GROW,
        Step.STOP_ROUTING,
        Step.DRAIN,
        Step.REDISPATCH,
        Step.RELEASE,
        Step.COMMIT,
    ),
    MigrationKind.REBOOT: (Step.SAVE, Step.STOP, Step.RESTART, Step.LOAD, Step.COMMIT),
}
"""Forward steps of each migration kind, in order; the last is always ``commit``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """The recorded result of one command."""

    migration_id: str
    """Migration the command belongs to."""
    step: Step
    """The command."""
    ok: bool
    """Whether it succeeded (a refused command is not ok)."""
    detail: str = ""
    """Why it failed or was refused; empty on success."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MigrationState:
    """Where one migration stands. Immutable: every transition returns a new state."""

    migration_id: str
    """Unique id."""
    kind: MigrationKind
    """Which life cycle it follows."""
    deadline: float
    """Lease deadline, seconds on the job clock; forward steps after it fail."""
    done: tuple[Outcome, ...] = ()
    """Outcomes recorded so far, in order (the idempotence log)."""

    @property
    def steps(self) -> tuple[Step, ...]:
        """Forward steps of this kind."""
        return KIND_STEPS[self.kind]

    def outcome(self, step: Step) -> Outcome | None:
        """The recorded outcome of ``step``, if any."""
        for outcome in self.done:
            if outcome.step is step:
                return outcome
        return None

    def succeeded(self, step: Step) -> bool:
        """Whether ``step`` completed successfully."""
        outcome = self.outcome(step)
        return outcome is not None and outcome.ok

    @property
    def committed(self) -> bool:
        """Whether the migration committed."""
        return self.succeeded(Step.COMMIT)

    @property
    def aborted(self) -> bool:
        """Whether an abort was recorded."""
        return self.succeeded(Step.ABORT)

    @property
    def rolled_back(self) -> bool:
        """Whether the previous allocation was restored."""
        return self.succeeded(Step.ROLLBACK)

    @property
    def failed(self) -> bool:
        """Whether a forward step failed (the migration can only be rolled back now)."""
        return any(not o.ok and o.step in self.steps for o in self.done)

    @property
    def phase(self) -> str:
        """``rolled_back``, ``aborted``, ``committed``, ``failed``, the last forward step
        that succeeded, or ``created``."""
        for name, flag in (
            ("rolled_back", self.rolled_back),
            ("aborted", self.aborted),
            ("committed", self.committed),
            ("failed", self.failed),
        ):
            if flag:
                return name
        done = [s for s in self.steps if self.succeeded(s)]
        return str(done[-1]) if done else "created"


@dataclass(frozen=True, kw_only=True, slots=True)
class Start:
    """What :func:`begin` decided: run the side effect now, or answer with ``outcome``."""

    run: bool
    """True: perform the step, then record it with :func:`finish`."""
    outcome: Outcome | None = None
    """When ``run`` is False: the answer (a replay of the earlier outcome, or a refusal)."""


def new_migration(
    migration_id: str, kind: MigrationKind, *, now: float, lease_s: float
) -> MigrationState:
    """A fresh migration whose lease runs ``lease_s`` seconds from ``now``.

    Raises ValueError for an empty id or a non-positive lease.
    """
    if not migration_id:
        raise ValueError("migration_id must not be empty")
    if lease_s <= 0:
        raise ValueError(f"lease_s must be > 0, got {lease_s}")
    return MigrationState(migration_id=migration_id, kind=kind, deadline=now + lease_s)


def begin(state: MigrationState, step: Step, *, now: float) -> Start:
    """Decide whether ``step`` may run now (pure).

    Replays a recorded outcome; refuses a step out of order, after commit (abort,
    rollback), before abort (rollback), after abort or failure (forward steps), and a
    forward step once the lease has expired.
    """
    recorded = state.outcome(step)
    if recorded is not None:
        return Start(run=False, outcome=recorded)

    def refuse(detail: str) -> Start:
        return Start(
            run=False,
            outcome=Outcome(migration_id=state.migration_id, step=step, ok=False, detail=detail),
        )

    if step is Step.ABORT:
        return refuse("already committed") if state.committed else Start(run=True)
    if step is Step.ROLLBACK:
        if state.aborted or state.failed:
            return Start(run=True)
        return refuse("rollback needs an abort first")
    if step not in state.steps:
        return refuse(f"{step} is not a step of a {state.kind} migration")
    if state.aborted or state.failed:
        return refuse("migration was aborted or failed; roll it back")
    previous = state.steps[: state.steps.index(step)]
    missing = [s for s in previous if not state.succeeded(s)]
    if missing:
        return refuse(f"{step} needs {missing[0]} first")
    if now > state.deadline:
        return refuse("lease expired")
    return Start(run=True)


def finish(state: MigrationState, step: Step, *, ok: bool, detail: str = "") -> MigrationState:
    """Record the result of a step that :func:`begin` allowed (pure)."""
    assert state.outcome(step) is None, f"{step} recorded twice"
    outcome = Outcome(migration_id=state.migration_id, step=step, ok=ok, detail=detail)
    return replace(state, done=(*state.done, outcome))


def record_refusal(state: MigrationState, start: Start) -> MigrationState:
    """Keep a lease-expiry refusal as the failure of that step, so it replays (pure)."""
    outcome = start.outcome
    if outcome is None or outcome.detail != "lease expired":
        return state
    return replace(state, done=(*state.done, outcome))


async def run_step(
    state: MigrationState, step: Step, *, now: float, action: Callable[[], Awaitable[str]]
) -> tuple[MigrationState, Outcome]:
    """Run ``action`` for ``step`` if :func:`begin` allows it and record the outcome.

    ``action`` returns "" on success or the reason of a failure; an exception it raises
    is recorded as a failure (and logged), never propagated. Runs on the caller's loop.
    """
    start = begin(state, step, now=now)
    if not start.run:
        assert start.outcome is not None
        return record_refusal(state, start), start.outcome
    try:
        detail = await action()
    except Exception as exc:
        logger.warning("migration %s: %s failed: %s", state.migration_id, step, exc)
        detail = f"{type(exc).__name__}: {exc}" or "failed"
        state = finish(state, step, ok=False, detail=detail)
    else:
        state = finish(state, step, ok=not detail, detail=detail)
    logger.info("migration %s: %s -> %s", state.migration_id, step, state.phase)
    outcome = state.outcome(step)
    assert outcome is not None
    return state, outcome
