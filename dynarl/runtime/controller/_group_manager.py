"""GroupManager: one component's manager, in the controller process, talking to workers
over the bus.

It binds its own endpoint (``manager/<component>``): the workers active in the component
send their ``WorkerMetrics`` there, so per-worker metrics never reach the controller's
socket; once per ``report_interval_s`` it folds them (``dynarl.sched``'s
:class:`~dynarl.sched.MetricsBuffer`) into one ``ComponentReport`` for the scheduler. It
holds the component's devices, its serving path (a :class:`~dynarl.runtime.controller._dispatch.
Dispatcher`, for serving components), the lock that orders user calls and migrations
(a migration waits for the call in progress: its step boundary), and the group-level
parts of migrations: activating and releasing roles, P2P reshard steps on every rank,
and the reboot host. Runs on the controller's event loop.

A worker of the component that dies outside a migration is skipped where nothing is left
to do on it (releasing or tearing down its role, aborting its requests). A non-serving
component loses its state with the rank (:attr:`GroupManager.lost`): calls on it raise
WorkerLostError, a reshard or reboot of it moves nothing (the forced reclaim of the dead
device only changes its devices and tears its surviving roles down), until a restore
(``DurableRun.restore``) starts fresh roles and loads its last checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from dynarl.bus import (
    BusConfig,
    BusServer,
    ComponentReport,
    CurveServer,
    MetaValue,
    Peer,
    Sample,
    WorkerMetrics,
)
from dynarl.errors import BusError, MigrationError
from dynarl.runtime._spec import ComponentSpec, RuntimeConfig
from dynarl.runtime._worker_protocol import (
    Activate,
    Call,
    CallResult,
    Deactivate,
    Done,
    LoadState,
    Reshard,
    RoleStatus,
    RuntimeMessage,
    SaveState,
    StepResult,
)
from dynarl.runtime.controller._dispatch import Dispatcher
from dynarl.runtime.controller._link import WorkerLink
from dynarl.runtime.controller._losses import Losses, WorkerLoss
from dynarl.runtime.worker import role_path
from dynarl.sched import Clock, MetricsBuffer

__all__ = ["GroupManager"]

logger = logging.getLogger(__name__)

Sink = Callable[[Sample], Coroutine[Any, Any, None]]

R = TypeVar("R")

_STATE_GONE = "its state is gone with it until DurableRun.restore loads the last checkpoint"


class GroupManager:
    """The manager of one component (see the module docstring)."""

    def __init__(
        self,
        spec: ComponentSpec,
        *,
        link: WorkerLink,
        config: RuntimeConfig,
        bus: BusConfig,
        clock: Clock,
        report: Callable[[ComponentReport], None],
        output: Sink,
        run_dir: Path,
        bind: str = "tcp://127.0.0.1:0",
        curve: CurveServer | None = None,
    ) -> None:
        """``bind``/``curve``: where the metrics endpoint listens, and its CURVE settings
        (the controller's host, any port: workers on other hosts report there too)."""
        self.spec, self.name = spec, spec.name
        self._link, self._config, self._clock, self._report = link, config, clock, report
        self._run_dir = run_dir
        self._path = role_path(spec.role)
        self.endpoint = BusServer(bind, name=f"manager/{spec.name}", config=bus, curve=curve)
        self.endpoint.route(WorkerMetrics, self._collect)
        self.lock = asyncio.Lock()
        """Held by user calls and by migrations of this component."""
        self.devices: tuple[int, ...] = ()
        self._positions: dict[int, int] = {}
        self._buffer = MetricsBuffer(spec.name, str(spec.kind), 0)
        self.iteration = 0
        self.remaining: int | None = None
        """Items of the iteration left, when the user says (else the workers' figures)."""
        self.lost: WorkerLoss | None = None
        """The worker loss that took this (non-serving) component's state, until
        :meth:`restored`."""
        self.recoverable = False
        """Whether a lost rank's state can be restored (a ``DurableRun`` checkpoints this
        component); if not, losing a rank ends the job."""
        self.dispatcher: Dispatcher | None = None
        if spec.serving:
            self.dispatcher = Dispatcher(
                spec.name,
                link=link,
                roles=self,
                output=output,
                max_inflight=spec.max_inflight,
                item_timeout_s=config.item_timeout_s,
                drain_timeout_s=config.drain_timeout_s,
                policy=spec.request_policy,
                max_overtakes=spec.max_overtakes,
                prefix_cache=spec.prefix_cache,
                # A stand-in link (a test's) may have no losses to share.
                losses=getattr(link, "losses", None),
            )

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Bind the metrics endpoint."""
        await self.endpoint.start()

    @property
    def request_timeout_s(self) -> float:
        """Deadline of one control request to a worker, seconds."""
        return self._config.request_timeout_s

    @property
    def address(self) -> str:
        """Where this component's workers send their metrics."""
        return self.endpoint.address

    async def run(self, stop: asyncio.Event) -> None:
        """Report every interval and serve, until ``stop`` is set."""
        async with asyncio.TaskGroup() as group:
            reporter = group.create_task(self._report_loop())
            if self.dispatcher is not None:
                group.create_task(self.dispatcher.run(stop))
            await stop.wait()
            reporter.cancel()

    async def aclose(self) -> None:
        """Close the metrics endpoint."""
        await self.endpoint.aclose()

    def set_devices(self, devices: Sequence[int]) -> None:
        """The component now holds ``devices`` (metrics columns follow)."""
        self.devices = tuple(sorted(devices))
        self._positions = {d: i for i, d in enumerate(self.devices)}
        self._buffer.resize(len(self.devices))

    def new_iteration(self, iteration: int) -> None:
        """An iteration boundary: completed counts start over."""
        self.iteration = iteration
        self._buffer.new_iteration()

    # ------------------------------------------------------------------ reports

    def _collect(self, metrics: WorkerMetrics, peer: Peer) -> None:
        device = peer.info.worker if peer.info is not None else -1
        position = self._positions.get(device)
        if position is None or metrics.component != self.name:
            return  # a worker that moved on: its figures are stale
        self._buffer.add(msgspec.structs.replace(metrics, worker=position))

    async def _report_loop(self) -> None:
        interval = self._config.report_interval_s
        last = self._clock.now()
        while True:
            await asyncio.sleep(interval)
            now = self._clock.now()
            self._report(self.build_report(now, now - last))
            last = now

    def build_report(self, now: float, interval_s: float) -> ComponentReport:
        """Fold the interval's metrics into one report (and start the next interval)."""
        remaining = self.remaining
        if self.dispatcher is not None and remaining is None:
            remaining = self.dispatcher.remaining
        report = self._buffer.report(
            time=now,
            interval_s=max(interval_s, 1e-6),
            remaining=remaining,
            iteration=self.iteration,
        )
        if self.dispatcher is not None:
            report = msgspec.structs.replace(report, queue_depth=self.dispatcher.queue_depth)
        return report

    # ------------------------------------------------------------------ roles

    def _activate(self, devices: Sequence[int], *, epoch: int, fresh: bool) -> Activate:
        return Activate(
            component=self.name,
            role=self._path,
            devices=tuple(sorted(devices)),
            options=dict(self.spec.options),
            manager=self.address,
            epoch=epoch,
            fresh=fresh,
        )

    async def activate(self, devices: Sequence[int], *, epoch: int = 0) -> None:
        """Make the role active on ``devices`` (woken, or created and started): within
        ``start_timeout_s``, as starting a role may launch its engine server."""
        message = self._activate(devices, epoch=epoch, fresh=True)
        deadline_s = max(self._config.start_timeout_s, self._config.request_timeout_s)
        await self._link.ask_all(devices, message, RoleStatus, deadline_s=deadline_s)

    async def release(self, devices: Sequence[int]) -> None:
        """Stop the role on ``devices`` (asleep with its state, or torn down; nothing to
        do where the worker died)."""
        message = Deactivate(component=self.name, keep=self.spec.keep_asleep)
        await self._link.ask_all(self._alive(devices), message, RoleStatus)

    async def teardown(self, devices: Sequence[int]) -> None:
        """Tear the role down on ``devices`` (nothing to do where the worker died)."""
        message = Deactivate(component=self.name, keep=False)
        await self._link.ask_all(self._alive(devices), message, RoleStatus)

    def _alive(self, devices: Sequence[int]) -> list[int]:
        """``devices`` but those whose worker is known to be dead."""
        return [d for d in devices if not self._losses.is_lost(d)]

    @property
    def _losses(self) -> Losses:
        return self._link.losses

    def restored(self) -> None:
        """Fresh roles hold the component's state again (a restore): calls go through."""
        if self.lost is not None:
            logger.warning("%s restored after %s", self.name, self.lost.describe())
        self.lost = None

    async def start_roles(self) -> None:
        """Activate the component on its initial devices (job start)."""
        self.set_devices(self.spec.devices)
        if self.devices:
            await self.activate(self.devices)
        if self.dispatcher is not None:
            for device in self.devices:
                self.dispatcher.add_worker(device)

    # ------------------------------------------------------------------ calls

    async def call(
        self,
        method: str,
        samples: Sequence[Sample],
        options: dict[str, MetaValue],
        *,
        deadline_s: float | None = None,
    ) -> list[CallResult]:
        """Run ``method`` on every worker of the component, at a step boundary.

        Raises WorkerLostError when a worker of the component died (or had died: its
        state is gone until a restore; fatal once the job cannot go on), else BusError
        (or a subclass) from the first worker that failed.
        """
        self._usable()
        async with self.lock:
            self._usable()
            message = Call(
                component=self.name, method=method, samples=tuple(samples), options=options
            )
            return await self.ask_workers(message, CallResult, deadline_s=deadline_s)

    def _usable(self) -> None:
        """Raise the job's fatal error, or the loss that took the component's state."""
        self._losses.raise_if_failed()
        if self.lost is not None:
            raise self.lost.error(_STATE_GONE, fatal=False)

    async def ask_workers(
        self, message: RuntimeMessage, reply: type[R], *, deadline_s: float | None = None
    ) -> list[R]:
        """Ask every worker of the component at once (a call, a checkpoint); replies in
        device order. A serving component's dead workers are left out.

        Raises WorkerLostError when one of them died (fatal once the job cannot go on),
        else as :meth:`WorkerLink.ask_all`. Who holds the component's lock is the caller's
        business.
        """
        losses = self._losses
        devices = self._alive(self.devices) if self.spec.serving else list(self.devices)

        async def ask(device: int) -> R:
            try:
                return await self._link.ask(device, message, reply, deadline_s=deadline_s)
            except BusError:
                # A failed rank is often a sign that another one died (a collective
                # broke): every worker of the component is judged now, so a dead one's
                # request fails at once instead of at its deadline.
                losses.suspect(*devices)
                losses.judge_now()
                raise

        asking = asyncio.gather(*[ask(d) for d in devices], return_exceptions=True)
        results: list[R | BaseException] = await losses.unless_failed(asking)
        failures = [r for r in results if isinstance(r, BaseException)]
        if not failures:
            return results  # type: ignore[return-value]
        loss = next((losses.lost[d] for d in devices if losses.is_lost(d)), None)
        if loss is not None:
            fatal = losses.failure()
            raise (fatal or loss.error(self._consequence, fatal=False)) from None
        raise failures[0]

    @property
    def _consequence(self) -> str:
        """What a lost worker means for a call on this component."""
        if self.spec.serving:
            return "the call did not complete there (its items continue on the others)"
        return _STATE_GONE

    # ------------------------------------------------------------------ P2P steps

    async def reshard(
        self,
        step: str,
        *,
        migration_id: str,
        src: Sequence[int],
        dst: Sequence[int],
        epoch: int,
        lease_s: float,
        only: Sequence[int] | None = None,
    ) -> list[StepResult]:
        """Run one reshard step on every rank of ``src`` and ``dst`` (or on ``only``
        those); one result per rank (a rank that could not be reached is a failed
        result)."""
        ranks = sorted(set(src) | set(dst))
        if only is not None:
            ranks = [rank for rank in ranks if rank in only]
        if self.lost is not None:
            return await self._reshard_lost(step, ranks)
        message = Reshard(
            migration_id=migration_id,
            step=step,
            component=self.name,
            role=self._path,
            options=dict(self.spec.options),
            manager=self.address,
            src=tuple(src),
            dst=tuple(dst),
            epoch=epoch,
            lease_s=lease_s,
        )
        replies = await asyncio.gather(
            *[self._link.ask(d, message, StepResult) for d in ranks], return_exceptions=True
        )
        return [
            r if isinstance(r, StepResult) else StepResult(device=d, ok=False, detail=repr(r))
            for d, r in zip(ranks, replies, strict=True)
        ]

    async def _reshard_lost(self, step: str, ranks: Sequence[int]) -> list[StepResult]:
        """The state died with a rank: there is nothing to reshard, so every step
        succeeds here; at commit the surviving ranks' roles are torn down (a restore
        starts fresh ones where the component then is)."""
        if step == "commit":
            alive = self._alive(ranks)
            message = Deactivate(component=self.name, keep=False)
            replies = await asyncio.gather(
                *[self._link.ask(d, message, RoleStatus) for d in alive], return_exceptions=True
            )
            for device, reply in zip(alive, replies, strict=True):
                if isinstance(reply, BaseException):
                    logger.warning("%s: teardown on %d failed: %r", self.name, device, reply)
        return [StepResult(device=d, ok=True, detail="") for d in ranks]

    # ------------------------------------------------------------------ reboot host

    def reboot_host(
        self, migration_id: str, *, epochs: Callable[[], int], in_place: bool
    ) -> RebootRoles:
        """The migrate ``RebootHost`` of one reboot of this component (``epochs`` hands
        out a fresh layout epoch for every start)."""
        return RebootRoles(self, migration_id=migration_id, epochs=epochs, in_place=in_place)


class RebootRoles:
    """The migrate ``RebootHost`` of a component: checkpoint, stop, start, load.

    With ``in_place`` the roles sleep and wake where they are instead (a component that
    shrinks to nothing, or grows back onto the devices where it sleeps): nothing is
    written, the state stays in the sleeping instances.
    """

    def __init__(
        self,
        manager: GroupManager,
        *,
        migration_id: str,
        epochs: Callable[[], int],
        in_place: bool,
    ) -> None:
        self._manager, self._id, self._in_place = manager, migration_id, in_place
        self._epochs = epochs
        self.running: tuple[int, ...] = manager.devices

    async def save(self) -> str:
        """Checkpoint the running roles (a directory under the run directory)."""
        if self._manager.lost is not None:
            return "lost"  # nothing left to save: a restore loads the last checkpoint
        if self._in_place:
            return "in-place"
        path = self._manager._run_dir / "reboot" / self._id
        path.mkdir(parents=True, exist_ok=True)
        message = SaveState(component=self._manager.name, path=str(path))
        await self._manager._link.ask_all(self.running, message, Done)
        return str(path)

    async def stop(self) -> None:
        """Stop the running roles (asleep in place, else torn down; where the worker
        died there is nothing to stop)."""
        running, self.running = self._manager._alive(self.running), ()
        keep = self._in_place and self._manager.lost is None
        if running:
            message = Deactivate(component=self._manager.name, keep=keep)
            await self._manager._link.ask_all(running, message, RoleStatus)

    async def start(self, resources: Sequence[int]) -> None:
        """Start (or wake, in place) the roles on ``resources`` (a component whose state
        was lost starts nothing: its restore does)."""
        if resources and self._manager.lost is None:
            await self._manager.activate(resources, epoch=self._epochs())
        self.running = tuple(sorted(resources))

    async def load(self, checkpoint: str) -> None:
        """Restore ``checkpoint`` into the running roles."""
        if self._in_place or not self.running or self._manager.lost is not None:
            return
        message = LoadState(component=self._manager.name, path=checkpoint)
        try:
            await self._manager._link.ask_all(self.running, message, Done)
        except BusError as exc:
            raise MigrationError(f"loading {checkpoint} failed: {exc}") from exc
