"""LossHandler: what the controller does when a worker dies outside a migration.

Each judging round (every tick of the controller, and at once when a suspect is named)
takes the suspects and the probe's findings from the job's
:class:`~dynarl.runtime.controller._losses.Losses` and judges each: no loss while the process
runs and the bus still hears it; not the handler's when the fault injector killed it (a
death inside a migration: the migration ends in its defined outcome and the caller
recovers, ``DurableRun.recover``). A lost device is a reclaimed device:

1. at once, requests to the worker fail; a serving component routes nothing more to it
   (its items continue on its other workers); a non-serving component (a trainer) lost its
   state with the rank: calls on it raise WorkerLostError until a restore, and the job
   cannot go on unless a ``DurableRun`` can restore it (``GroupManager.recoverable``);
2. the scheduler takes ``QuotaChange(reclaimed=(device,), lost=True)``, the quota path of a
   cluster reclaim: the device leaves the quota, and a component it leaves short (its last
   worker) is given devices from the free ones or from a component that can spare them;
   the coordinator carries the forced command out (workload migrations that skip the dead
   worker, a trainer whose state died resharding nothing);
3. when the plan is refused or the reclaim keeps failing, the job cannot go on: one
   WorkerLostError, naming the component, worker, device and how it ended, is recorded
   (:meth:`Losses.fail`) and raised by every call, submission and output of the job.

Runs on the controller's event loop (in its tick task).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from dynarl.runtime._faults import FaultAction, FaultInjector
from dynarl.runtime.controller._coordinator import Coordinator
from dynarl.runtime.controller._group_manager import GroupManager
from dynarl.runtime.controller._link import WorkerLink, worker_name
from dynarl.runtime.controller._losses import WorkerLoss, exit_cause
from dynarl.sched import QuotaChange, Scheduler, SchedulerEvent

__all__ = ["LossHandler", "num_kills"]

logger = logging.getLogger(__name__)

_ATTEMPTS = 3
"""Reclaims tried before the job gives up (a move in flight can make one stale)."""
_IN_STEP_S = 5.0
"""How long a reclaim waits for the scheduler to take in the allocation in force."""
_NO_RESTORE = (
    "its state lived there and no checkpoint can restore it (a DurableRun checkpoints a trainer)"
)


_TAKE_OUT = (FaultAction.KILL, FaultAction.CUT)


def num_kills(faults: FaultInjector, device: int) -> int:
    """Faults that took ``device``'s worker out so far: kills, and cuts of its host's link
    (a cut worker misses the controller's heartbeats and leaves by itself)."""
    return sum(1 for f in faults.fired if f.action in _TAKE_OUT and f.device == device)


class LossHandler:
    """Judges suspect workers and reclaims the devices of the dead (see the module
    docstring)."""

    def __init__(
        self,
        *,
        link: WorkerLink,
        managers: Mapping[str, GroupManager],
        scheduler: Scheduler,
        coordinator: Coordinator,
        faults: FaultInjector,
        post: Callable[[SchedulerEvent], None],
    ) -> None:
        self._link, self._managers = link, managers
        self._scheduler, self._coordinator = scheduler, coordinator
        self._faults, self._post = faults, post
        self._losses = link.losses
        self._pending: list[WorkerLoss] = []
        self._losses.bind(self.judge)

    def judge(self) -> None:
        """Judge every suspect (and every local worker whose process ended) now and do
        what each loss changes at once; their reclaims wait for :meth:`round`. Runs
        wherever a failure is seen (a call, the serving path), never waits."""
        for device, seen in sorted(self._losses.candidates().items()):
            loss = self._judge(device, seen)
            if loss is not None and self._take(loss):
                self._pending.append(loss)
        if self._pending:
            self._losses.changed.set()

    async def round(self) -> None:
        """Judge, then reclaim the device of every loss; returns once their reclaims
        ended."""
        answered = self._losses.begin()
        try:
            self.judge()
            while self._pending:
                loss = self._pending.pop(0)
                if self._losses.failure() is None:  # a failed job reclaims nothing more
                    await self._reclaim(loss)
        finally:
            self._losses.settle(answered)

    def _judge(self, device: int, seen: str) -> WorkerLoss | None:
        worker = self._losses.registration(device)
        if worker is None or self._losses.is_lost(device):
            return None
        cause = exit_cause(worker.pid) if worker.local else None
        peer = self._link.server.peer(worker_name(device))
        heard = peer is not None and peer.info is not None and peer.info.pid == worker.pid
        if cause is None and heard:
            return None  # it runs, and the bus still hears it
        if num_kills(self._faults, device) > worker.kills:
            logger.info(
                "worker %d was taken out by the fault injector: left to its migration", device
            )
            self._losses.ignore(device)
            return None
        holder = next(
            (name for name, devs in self._coordinator.allocation.assignment if device in devs), ""
        )
        return WorkerLoss(
            device=device, cause=cause or seen or "missed heartbeats", pid=worker.pid,
            component=holder,
        )  # fmt: skip

    def _take(self, loss: WorkerLoss) -> bool:
        """What a loss changes at once; whether its device is to be reclaimed."""
        self._losses.lose(loss)
        logger.warning("%s", loss.describe())
        manager = self._managers.get(loss.component)
        if manager is None:
            return True
        if manager.dispatcher is not None:
            manager.dispatcher.lose_worker(loss.device)
            return True
        manager.lost = manager.lost or loss
        if not manager.recoverable:
            self._fail(loss, _NO_RESTORE)
            return False
        return True

    def _fail(self, loss: WorkerLoss, consequence: str) -> None:
        if self._losses.failure() is None:
            self._losses.fail(loss, f"{consequence}; the job cannot go on")
            logger.error("%s", self._losses.failure())

    def _holds(self, device: int) -> bool:
        return any(device in devs for _, devs in self._coordinator.allocation.assignment)

    async def _reclaim(self, loss: WorkerLoss) -> None:
        """Reclaim ``loss``'s device through the quota path (see the module docstring)."""
        why = ""
        try:
            for _ in range(_ATTEMPTS):
                await self._in_step()
                # Even a device no component holds leaves the quota: nothing plans on it.
                change = QuotaChange(reclaimed=(loss.device,), lost=True)
                commands = self._scheduler.handle(change)
                if not commands and self._holds(loss.device):
                    decision = self._scheduler.last_decision
                    self._fail(loss, str(decision.reason) if decision else "reclaim refused")
                    return
                for command in commands:
                    outcome = await self._coordinator.execute(command)
                    self._post(outcome)
                    why = outcome.reason or why
                if not self._holds(loss.device):
                    break
            else:
                self._fail(loss, f"its device could not be reclaimed ({why})")
                return
        except Exception as exc:  # the handler's boundary: the job stops with one error
            logger.exception("reclaiming device %d failed", loss.device)
            self._fail(loss, f"its device could not be reclaimed ({type(exc).__name__}: {exc})")
            return
        self._losses.reclaimed.add(loss.device)
        logger.warning(
            "device %d reclaimed after %s: allocation %s",
            loss.device,
            loss.describe(),
            self._coordinator.allocation.as_dict(),
        )

    async def _in_step(self) -> None:
        """Wait (a bounded while) until the scheduler took in the allocation in force,
        so that its plan starts from it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _IN_STEP_S
        while self._scheduler.allocation != self._coordinator.allocation:
            if loop.time() > deadline:
                return
            await asyncio.sleep(0.02)
