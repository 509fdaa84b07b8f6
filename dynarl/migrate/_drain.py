"""WorkloadMigration: move devices away from a rollout, inference, reward or tool component.

The donor workers stop receiving requests (``stop_routing``), their in-flight requests are
aborted and collected with their partial outputs, prompt plus generated tokens
(``drain``), re-dispatched to the remaining workers with their priority and affinity
(``redispatch``), the donors release their memory (``release``) and the devices go to the
receiver (``commit``). ``interrupt()`` performs the first two steps (it reaches a query
boundary by aborting in-flight work); ``migrate(dest_resources)`` the rest.

No request is lost or duplicated: drained requests are recorded once (a repeated ``drain``
returns the same list and aborts nothing again), re-dispatched once, and checked for
duplicate ids. ``abort`` then ``rollback`` before commit resumes routing to the donors
(re-acquiring memory if it was released) and re-dispatches drained requests that had not
been re-dispatched yet; requests already re-dispatched stay where they went, so nothing
runs twice.

The component itself is injected as a :class:`WorkloadHost` (the runtime's group manager
implements it). Runs on the manager's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dynarl.migrate._protocol import Outcome, Step, StepRunner
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
        """Queue ``requests`` on ``workers``, keeping priority and affinity."""
        ...

    async def release(self, workers: Sequence[int]) -> None:
        """Free the memory (KV cache, weights) held by ``workers``."""
        ...

    async def resume(self, workers: Sequence[int]) -> None:
        """Undo a move before commit: re-acquire memory if released, route to them again."""
        ...


class WorkloadMigration(StepRunner):
    """Take ``donors`` away from a component; ``remaining`` workers take over their work.

    Raises ValueError when donors and remaining overlap or no worker remains.
    """

    def __init__(
        self,
        *,
        migration_id: str,
        donors: Sequence[int],
        remaining: Sequence[int],
        host: WorkloadHost,
        lease_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if set(donors) & set(remaining):
            raise ValueError(f"donors {sorted(donors)} overlap remaining {sorted(remaining)}")
        if not remaining or not donors:
            raise ValueError("a workload migration needs donors and at least one remaining worker")
        self.donors, self.remaining = tuple(donors), tuple(remaining)
        self._host = host
        super().__init__(migration_id, MigrationKind.WORKLOAD, lease_s=lease_s, clock=clock)
        self.drained: tuple[PartialRequest, ...] = ()
        self.dispatched: tuple[str, ...] = ()

    async def stop_routing(self) -> Outcome:
        """Stop sending requests to the donors."""
        return await self._step(Step.STOP_ROUTING, self._stop_routing)

    async def _stop_routing(self) -> str:
        await self._host.stop_routing(self.donors)
        return ""

    async def drain(self) -> Outcome:
        """Abort the donors' in-flight requests and keep their partial outputs (once)."""
        return await self._step(Step.DRAIN, self._drain)

    async def _drain(self) -> str:
        requests = tuple(await self._host.abort_inflight(self.donors))
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            return f"drained duplicate request ids {sorted({i for i in ids if ids.count(i) > 1})}"
        self.drained = requests
        return ""

    async def redispatch(self) -> Outcome:
        """Hand every drained request to the remaining workers, exactly once."""
        return await self._step(Step.REDISPATCH, self._redispatch)

    async def _redispatch(self) -> str:
        await self._host.redispatch(self.drained, self.remaining)
        self.dispatched = tuple(r.request_id for r in self.drained)
        return ""

    async def release(self) -> Outcome:
        """Free the donors' memory."""
        return await self._step(Step.RELEASE, self._release)

    async def _release(self) -> str:
        await self._host.release(self.donors)
        return ""

    async def commit(self) -> Outcome:
        """The donors' devices now belong to the receiver."""
        return await self._step(Step.COMMIT, self._nothing)

    async def abort(self, reason: str = "aborted") -> Outcome:
        """Stop before commit; ``rollback`` resumes the donors."""
        return await self._step(Step.ABORT, self._nothing)

    async def rollback(self) -> Outcome:
        """Route to the donors again (re-acquiring memory if it was released)."""
        return await self._step(Step.ROLLBACK, self._resume)

    async def _resume(self) -> str:
        await self._host.resume(self.donors)
        sent = set(self.dispatched)
        pending = tuple(r for r in self.drained if r.request_id not in sent)
        if pending:  # drained but never re-dispatched: they must not be lost
            await self._host.redispatch(pending, self.donors + self.remaining)
            self.dispatched += tuple(r.request_id for r in pending)
        return ""

    async def _nothing(self) -> str:
        return ""

    async def interrupt(self) -> None:
        """Reach a query boundary on the donors: stop routing, then drain."""
        for step in (self.stop_routing, self.drain):
            if not (await step()).ok:
                return

    async def migrate(self, dest_resources: Sequence[int]) -> Outcome:
        """Re-dispatch, release and commit (interrupting first if needed); on a failure,
        abort and roll back. ``dest_resources`` are the devices handed over: the donors.
        Raises ValueError when they are not the donors."""
        if sorted(dest_resources) != sorted(self.donors):
            raise ValueError(f"dest_resources {sorted(dest_resources)} are not the donors")
        steps = (self.stop_routing, self.drain, self.redispatch, self.release, self.commit)
        for step in steps:
            outcome = await step()
            if not outcome.ok:
                return await self.cancel(outcome.detail)
        return outcome

    async def cancel(self, reason: str) -> Outcome:
        """Abort and roll back; returns the rollback outcome."""
        await self.abort(reason)
        return await self.rollback()
