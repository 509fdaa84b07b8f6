"""WorkloadMigration: move devices to and from a rollout, inference, reward or tool component.

Workers that join are started (``grow``) but not routed to yet; the donor workers stop
receiving requests (``stop_routing``), their in-flight requests are aborted and collected
with their partial outputs, prompt plus generated tokens (``drain``), re-dispatched to the
remaining workers with their priority and affinity (``redispatch``), the donors release
their memory (``release``) and the devices change hands (``commit``: the joining workers
are routed to). ``interrupt()`` performs the steps up to ``drain`` (it reaches a query
boundary by aborting in-flight work); ``migrate(dest_resources)`` the rest.

Either side may be empty. A component that shrinks to no worker keeps its drained
requests in the host (``redispatch`` to no worker) until a worker is admitted; one that
grows from none has nothing to drain. Steps with no worker to act on do no I/O.

No request is lost or duplicated: drained requests are recorded once (a repeated ``drain``
returns the same list and aborts nothing again), re-dispatched once, and checked for
duplicate ids. ``abort`` then ``rollback`` before commit resumes routing to the donors
(re-acquiring memory if it was released), re-dispatches drained requests that had not
been re-dispatched yet (requests already re-dispatched stay where they went, so nothing
runs twice) and releases the workers that joined.

The component itself is injected as a :class:`WorkloadHost` (the runtime's dispatcher and
group manager implement it). Runs on the manager's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dynarl.migrate._protocol import Outcome, Step
from dynarl.migrate._step_runner import Action, StepHook, StepRunner, nothing
from dynarl.types import MigrationKind

__all__ = ["PartialRequest", "WorkloadHost", "WorkloadMigration"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PartialRequest:
    """An aborted in-flight request with what it had produced so far."""

    request_id: str
    """Unique id of the request."""
    prompt: tuple[int, ...]
    """Prompt token ids."""
    generated: tuple[int, ...] = ()
    """Tokens generated before the abort (resumed from, not regenerated)."""
    priority: tuple[float, ...] = ()
    """The scheduler's priority key, kept across the move."""
    affinity: str = "none"
    """``must``, ``prefer`` or ``none``: how strongly it sticks to a worker."""
    affinity_worker: int | None = None
    """The worker it is affine to, if any."""


class WorkloadHost(Protocol):
    """The component whose devices move, as seen by its group manager."""

    async def stop_routing(self, workers: Sequence[int]) -> None:
        """Send no new requests to ``workers``."""
        ...

    async def abort_inflight(self, workers: Sequence[int]) -> Sequence[PartialRequest]:
        """Abort the requests running on ``workers`` and return them with partial outputs."""
        ...

    async def redispatch(self, requests: Sequence[PartialRequest], workers: Sequence[int]) -> None:
        """Queue ``requests`` on ``workers``, keeping priority and affinity; with no worker
        routed to, hold them until one is admitted."""
        ...

    async def release(self, workers: Sequence[int]) -> None:
        """Free the memory (KV cache, weights) held by ``workers``."""
        ...

    async def resume(self, workers: Sequence[int]) -> None:
        """Undo a move before commit: re-acquire memory if released, route to them again."""
        ...

    async def activate(self, workers: Sequence[int]) -> None:
        """Start the role on joining ``workers``, without routing to them yet (grow only)."""
        ...

    async def admit(self, workers: Sequence[int]) -> None:
        """Route to joining ``workers`` (at commit); requests held while no worker was
        left go to them (grow only)."""
        ...


class WorkloadMigration(StepRunner):
    """Take ``donors`` away from a component and add ``added`` to it; ``remaining`` (the
    workers it holds afterwards) take over the donors' work.

    Raises ValueError when donors overlap remaining, when ``added`` are not among the
    remaining, or when nothing moves.
    """

    _PAUSED = (Step.STOP_ROUTING, Step.REDISPATCH)

    def __init__(
        self,
        *,
        migration_id: str,
        donors: Sequence[int],
        remaining: Sequence[int],
        host: WorkloadHost,
        added: Sequence[int] = (),
        lease_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_step: StepHook | None = None,
    ) -> None:
        if set(donors) & set(remaining):
            raise ValueError(f"donors {sorted(donors)} overlap remaining {sorted(remaining)}")
        if not set(added) <= set(remaining):
            raise ValueError(f"added {sorted(added)} are not among remaining {sorted(remaining)}")
        if not donors and not added:
            raise ValueError("a workload migration needs donors or workers to add")
        self.donors, self.remaining = tuple(donors), tuple(remaining)
        self.added = tuple(added)
        self._host = host
        super().__init__(
            migration_id, MigrationKind.WORKLOAD, lease_s=lease_s, clock=clock, on_step=on_step
        )
        self.drained: tuple[PartialRequest, ...] = ()
        self.dispatched: tuple[str, ...] = ()

    def _action(self, step: Step) -> Action:
        actions: dict[Step, Action] = {
            Step.GROW: self._grow,
            Step.STOP_ROUTING: self._stop_routing,
            Step.DRAIN: self._drain,
            Step.REDISPATCH: self._redispatch,
            Step.RELEASE: self._release,
            Step.COMMIT: self._admit,
            Step.ABORT: nothing,
            Step.ROLLBACK: self._resume,
        }
        return actions[step]

    async def grow(self) -> Outcome:
        """Start the role on the workers that join (not routed to before commit)."""
        return await self._run(Step.GROW)

    async def _grow(self) -> str:
        if self.added:
            await self._host.activate(self.added)
        return ""

    async def stop_routing(self) -> Outcome:
        """Stop sending requests to the donors."""
        return await self._run(Step.STOP_ROUTING)

    async def _stop_routing(self) -> str:
        if self.donors:
            await self._host.stop_routing(self.donors)
        return ""

    async def drain(self) -> Outcome:
        """Abort the donors' in-flight requests and keep their partial outputs (once)."""
        return await self._run(Step.DRAIN)

    async def _drain(self) -> str:
        if not self.donors:
            return ""
        requests = tuple(await self._host.abort_inflight(self.donors))
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            return f"drained duplicate request ids {sorted({i for i in ids if ids.count(i) > 1})}"
        self.drained = requests
        return ""

    async def redispatch(self) -> Outcome:
        """Hand every drained request to the remaining workers (held by the host when
        none is left), exactly once."""
        return await self._run(Step.REDISPATCH)

    async def _redispatch(self) -> str:
        if self.donors:
            await self._host.redispatch(self.drained, self.remaining)
            self.dispatched = tuple(r.request_id for r in self.drained)
        return ""

    async def release(self) -> Outcome:
        """Free the donors' memory."""
        return await self._run(Step.RELEASE)

    async def _release(self) -> str:
        if self.donors:
            await self._host.release(self.donors)
        return ""

    async def _admit(self) -> str:
        if self.added:
            await self._host.admit(self.added)
        return ""

    async def _resume(self) -> str:
        if self.donors:
            await self._host.resume(self.donors)
        sent = set(self.dispatched)
        pending = tuple(r for r in self.drained if r.request_id not in sent)
        if pending:  # drained but never re-dispatched: they must not be lost
            await self._host.redispatch(pending, self.donors + self.remaining)
            self.dispatched += tuple(r.request_id for r in pending)
        if self._state.succeeded(Step.GROW) and self.added:
            await self._host.release(self.added)
        return ""

    async def interrupt(self) -> None:
        """Reach a query boundary on the donors: the steps up to ``drain``."""
        steps = self._state.steps
        for step in steps[: steps.index(Step.DRAIN) + 1]:
            if not (await self._run(step)).ok:
                return

    async def migrate(self, dest_resources: Sequence[int]) -> Outcome:
        """Every step to commit (interrupting first if needed); on a failure, abort and
        roll back. ``dest_resources`` are the devices handed over: the donors. Raises
        ValueError when they are not the donors."""
        if sorted(dest_resources) != sorted(self.donors):
            raise ValueError(f"dest_resources {sorted(dest_resources)} are not the donors")
        return await super().migrate(dest_resources)
