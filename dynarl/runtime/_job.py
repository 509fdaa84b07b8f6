"""``dynarl.Job``: dynarl embedded in the user's own RL loop.

::

    async with dynarl.Job([ComponentSpec(role=MyRollout, devices=(0, 1)),
                           ComponentSpec(role=MyTrainer, devices=(2,))]) as job:
        job.submit("rollout", requests)              # routed, served, re-dispatched on moves
        samples = job.output("rollout")               # a Channel of finished Samples
        batch = [await samples.get() for _ in requests]
        await job.call("trainer", "train_step", batch)   # on every trainer rank, SPMD
        print(job.allocation, len(job.ledger))

Entering starts the controller in this process (on this event loop) and one worker process
per device through its launcher (a :class:`~dynarl.runtime.launch.WorkerLauncher`: by default
the :class:`~dynarl.runtime.launch.LocalLauncher` on this machine; under torchrun,
``python -m dynarl.runtime.launch`` runs a :class:`~dynarl.runtime.JobSpec` with the ranks as
the workers), waits for them to register, and activates every component on its initial
devices; the scheduler then runs beside the user's code and moves devices when a component
is over-provisioned. Leaving tells the workers to go and stops every process the job
started. The user's loop keeps control throughout: nothing here blocks the loop. Runs on the
user's event loop.

While the workers start, the job reads the pipeline graph from the modules that define its
roles and checks it against the declared components
(:mod:`dynarl.runtime._graph_check`): each finding, a role the code sends to that the job
does not declare or a declared component no channel of the code reaches, is logged as a
warning and recorded in the ledger as a
:class:`~dynarl.sched.GraphFindingRecord`. Never an error: unparsable modules and dynamic
sends are skipped.

With ``JobConfig.durable`` the job keeps its allocation journal at ``run_dir/journal``:
started again on the same run directory it recovers the last committed allocation (a
migration caught in flight is journalled as rolled back: the new workers hold nothing
of it) and starts every component there; :class:`~dynarl.runtime.DurableRun`
adds checkpoints, the sample stream and the sample manifest. :meth:`Job.respawn`
starts again worker processes that died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import secrets
import sys
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from dynarl._resource import AsyncResource, stage
from dynarl.bus import Channel, MetaValue, Sample
from dynarl.errors import IntegrityError, WorkerError
from dynarl.runtime._cores import CoreClock, CoreUsage, pinned_cores
from dynarl.runtime._faults import FaultInjector
from dynarl.runtime._graph_check import GraphCheck, check_roles
from dynarl.runtime._spec import ComponentSpec, RuntimeConfig
from dynarl.runtime._worker_protocol import CallResult
from dynarl.runtime.controller import (
    AllocationJournal,
    Controller,
    Item,
    MetricsExporter,
    worker_name,
)
from dynarl.runtime.durable import Journal
from dynarl.runtime.launch import LocalLauncher, WorkerLauncher
from dynarl.runtime.worker import WorkerOptions
from dynarl.sched import (
    DeviceMove,
    Ledger,
    MigrationCommand,
    MoveOutcome,
    OperatorCommand,
    Scheduler,
    ThroughputPredictor,
)
from dynarl.types import Allocation

__all__ = ["Job", "JobConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """How a job starts on this machine."""

    num_devices: int | None = None
    """Worker processes (devices) to start; None: one past the highest device named."""
    run_dir: str | None = None
    """Directory for the ledger, worker logs and checkpoints (None: a new temporary one)."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """The controller's settings."""
    python: str = sys.executable
    """Interpreter of the worker processes (the local launcher)."""
    worker_env: Mapping[str, str] | None = None
    """Environment of the worker processes (the local launcher; None: this process's)."""
    durable: bool = False
    """Keep the allocation journal at ``run_dir/journal`` and start from the allocation
    it holds (a restarted job needs the same ``run_dir``)."""

    def __post_init__(self) -> None:
        if self.num_devices is not None and self.num_devices < 1:
            raise ValueError(f"JobConfig.num_devices must be >= 1, got {self.num_devices}")


class Job(AsyncResource):
    """A dynarl job embedded in the caller's event loop (see the module docstring).

    ``predictor`` replaces the scheduler's default throughput predictor (a
    :class:`~dynarl.sched.RegressionPredictor` over the components' profiles);
    ``launcher`` starts the workers (None: a
    :class:`~dynarl.runtime.launch.LocalLauncher` of ``config.python`` and
    ``config.worker_env``, logging to ``run_dir/workers``, its devices pinned to cores when
    ``RuntimeConfig.pin_cores``). Raises ValueError for bad component specs. Constructing
    does no I/O: entering opens, in this order (each a named start-up stage):

    ============================  =================================================
    ``journal open``              the allocation journal (``durable`` jobs), and the
                                  allocation recovered from it: IntegrityError
    ``store``                     the job's TCPStore: WorkerError
    ``publisher``                 the event publisher: BusError
    ``bus bind``                  the bus server and the managers' endpoints: BusError
    ``metrics port``              the Prometheus endpoint: DynarlError
    ``worker spawn``              the launcher starts one worker per device:
                                  WorkerError
    ``worker registration``       every worker registered on the bus (a worker that
                                  dies, or ``start_timeout_s``): WorkerError
    ``rendezvous``                every component activated on its devices (the
                                  workers build their process groups over the
                                  store): WorkerError
    ============================  =================================================

    A stage that fails raises that error with the message ``start-up failed at stage
    '<stage>': <cause type>: <cause>``, chained to the cause, once whatever opened before
    it is closed again in reverse order. Leaving the ``async with`` block closes
    everything the same way, whether the block ends, raises or is cancelled.
    """

    def __init__(
        self,
        components: Sequence[ComponentSpec],
        config: JobConfig | None = None,
        *,
        journal: AllocationJournal | None = None,
        predictor: ThroughputPredictor | None = None,
        launcher: WorkerLauncher | None = None,
    ) -> None:
        if not components:
            raise ValueError("a job needs at least one component")
        self.config = config or JobConfig()
        held = [d for spec in components for d in spec.devices]
        self.num_devices = self.config.num_devices or (max(held) + 1 if held else 1)
        self._temporary = self.config.run_dir is None
        self.run_dir = (
            Path(tempfile.gettempdir(), f"dynarl-job-{secrets.token_hex(8)}")
            if self.config.run_dir is None
            else Path(self.config.run_dir)
        )
        """The run directory (created when the job starts)."""
        self.journal: Journal | None = None
        """The allocation journal (``durable`` jobs, once started)."""
        self._components = tuple(components)
        self._given_journal = journal
        self._predictor = predictor
        self._launcher: WorkerLauncher = launcher or LocalLauncher(
            python=self.config.python,
            env=self.config.worker_env,
            log_dir=self.run_dir / "workers",
        )
        self._controller = self._new_controller(self._components, journal)
        self._modules = tuple(sorted({spec.role.__module__ for spec in components}))
        self._cores = (
            pinned_cores(self.num_devices, os.sched_getaffinity(0))
            if self.config.runtime.pin_cores and launcher is None
            else {}
        )
        self._core_clock: CoreClock | None = None
        self._ids = itertools.count(1)
        self._iteration = 0

    def _new_controller(
        self,
        components: Sequence[ComponentSpec],
        journal: AllocationJournal | None,
        first_decision: int = 1,
    ) -> Controller:
        return Controller(
            components,
            num_devices=self.num_devices,
            run_dir=self.run_dir,
            config=self.config.runtime,
            kill=self._kill,
            journal=journal,
            store=self._launcher.store,
            bind=self._launcher.bind,
            curve=self._launcher.curve,
            predictor=self._predictor,
            first_decision=first_decision,
        )

    # ------------------------------------------------------------------ life cycle

    async def _open(self, stack: AsyncExitStack) -> None:
        if self._temporary:
            self.run_dir.mkdir(mode=0o700)
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._core_clock = CoreClock(self._cores)
        stack.callback(self._write_core_usage)  # runs last: after every worker stopped
        if self.config.durable and self._given_journal is None:
            with stage("journal open", IntegrityError):
                self.journal = journal = Journal(self.run_dir / "journal", job="dynarl")
                stack.callback(journal.close)
                recovered = _recovered(self._components, journal)
                # Decision ids continue past the migrations an earlier controller began.
                first = journal.state.migrations_begun + 1
                self._ids = itertools.count(first)
                self._controller = self._new_controller(recovered, journal, first)
        # The launcher before the controller: workers are told to leave over the bus
        # before their processes are stopped.
        launcher = await stack.enter_async_context(self._launcher)
        await stack.enter_async_context(self._controller)
        devices = range(self.num_devices)
        with stage("worker spawn", WorkerError):
            await launcher.start([self._options(device) for device in devices])
        specs = list(self._controller.specs.values())
        self._report_graph(await asyncio.to_thread(check_roles, specs))
        with stage("worker registration", WorkerError):
            await self._wait_for_workers(devices)
        with stage("rendezvous", WorkerError):
            await self._controller.start_roles()
        logger.info("job started: %d workers, run directory %s", self.num_devices, self.run_dir)

    async def aclose(self) -> None:
        """Tell every worker to leave, stop the controller, stop every process started,
        close the journal: in reverse order of opening (idempotent)."""
        await super().aclose()

    async def _wait_for_workers(self, devices: Sequence[int]) -> None:
        try:
            await self._controller.wait_for_workers(devices, alive=self._check_alive)
        except TimeoutError:
            missing = sorted(set(devices) - self._controller.link.registered())
            seconds = self.config.runtime.start_timeout_s
            raise TimeoutError(f"workers {missing} did not register within {seconds:g} s") from None

    async def respawn(self) -> tuple[int, ...]:
        """Start again every worker process of this job that died, and wait until each
        has registered; returns their devices. They host no role yet.

        Raises WorkerError if one dies again while starting, TimeoutError after
        ``RuntimeConfig.start_timeout_s``. Under torchrun nothing is started here: the
        agent restarts ranks itself (``--max-restarts``).
        """
        dead = self._launcher.exited()
        if not dead:
            return ()
        server = self._controller.server
        before = {d: server.peer(worker_name(d)) for d in dead}
        logger.warning("respawning the workers of devices %s", list(dead))
        await self._launcher.start([self._options(device) for device in dead])
        async with asyncio.timeout(self.config.runtime.start_timeout_s):
            while True:
                self._check_alive()
                now = {d: server.peer(worker_name(d)) for d in dead}
                if all(now[d] is not None and now[d] is not before[d] for d in dead):
                    return dead
                await asyncio.sleep(0.05)

    def _report_graph(self, check: GraphCheck) -> None:
        """Log each finding of the start-up graph check once and record it in the ledger."""
        now = self._controller.scheduler.clock.now()
        for number, finding in enumerate(check.findings, 1):
            logger.warning("graph check: %s", finding)
            self.ledger.append(finding.record(f"g{number:06d}", now))
        if check.skipped:
            logger.info("graph check: role modules not read: %s", "; ".join(check.skipped))
        if check.num_unresolved:
            logger.info(
                "graph check: %d sites of the role code not resolved, not judged",
                check.num_unresolved,
            )

    def _options(self, device: int) -> WorkerOptions:
        runtime = self.config.runtime
        return WorkerOptions(
            controller=self._controller.address,
            device=device,
            store_port=self._controller.store_port,
            store_timeout_s=runtime.collective_timeout_s,
            metrics_interval_s=runtime.metrics_interval_s,
            collective_timeout_s=runtime.collective_timeout_s,
            preload=self._modules,
            cpus=(self._cores[device],) if self._cores else (),
        )

    def _check_alive(self) -> None:
        self._launcher.check()

    def _kill(self, device: int) -> None:
        self._launcher.kill(device)

    # ------------------------------------------------------------------ state

    @property
    def allocation(self) -> Allocation:
        """The allocation in force."""
        return self._controller.allocation

    @property
    def ledger(self) -> Ledger:
        """Every decision and migration record (also in ``run_dir/events.jsonl``)."""
        return self._controller.ledger

    @property
    def metrics(self) -> MetricsExporter | None:
        """The Prometheus endpoint (``RuntimeConfig.metrics_port``), or None; feed it the
        ``dynamic_resource/*`` metrics with ``record_cycle``."""
        return self._controller.metrics

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (read its decisions; steer it with :meth:`operator`)."""
        return self._controller.scheduler

    @property
    def faults(self) -> FaultInjector:
        """Arm faults at named migration phases (tests)."""
        return self._controller.faults

    @property
    def controller(self) -> Controller:
        """The controller (managers, link, coordinator), for tools and tests."""
        return self._controller

    def workers(self) -> dict[int, int]:
        """``{device: pid}`` of the worker processes still running."""
        return self._launcher.pids()

    def core_usage(self) -> CoreUsage:
        """Each CPU core's busy seconds since the job started (every core of this host, the
        job's and others'), and the core each device is pinned to
        (``RuntimeConfig.pin_cores``). Written to ``run_dir/cores.json`` when the job ends.
        RuntimeError before the job starts."""
        if self._core_clock is None:
            raise RuntimeError("the job has not started: no core usage yet")
        return self._core_clock.usage()

    def _write_core_usage(self) -> None:
        usage = self.core_usage()
        (self.run_dir / "cores.json").write_text(json.dumps(usage.to_json(), indent=1) + "\n")
        if self._cores:
            logger.info(
                "core busy time: %s",
                ", ".join(
                    f"device {d} (core {c}) {usage.busy_s[c]:.1f} s"
                    for d, c in sorted(self._cores.items())
                ),
            )

    # ------------------------------------------------------------------ data and calls

    def channel(self, name: str, *, capacity: int | None = None) -> Channel[Sample]:
        """The ``Sample`` channel ``name`` of this job (hosted by the controller)."""
        return self._controller.channel(name, capacity=capacity)

    def output(self, component: str) -> Channel[Sample]:
        """The channel a serving component puts its finished samples into."""
        spec = self._controller.manager(component).spec
        return self.channel(spec.output_channel)

    def submit(self, component: str, items: Sequence[Item]) -> None:
        """Hand ``items`` to a serving component; each finished sample comes out of
        :meth:`output` exactly once, whatever moves happen meanwhile.

        Raises ValueError for a component that does not serve, or an id already submitted.
        """
        dispatcher = self._controller.manager(component).dispatcher
        if dispatcher is None:
            raise ValueError(f"component {component!r} does not serve items")
        dispatcher.submit(items)

    async def call(
        self,
        component: str,
        method: str,
        samples: Sequence[Sample] = (),
        *,
        deadline_s: float | None = None,
        **options: MetaValue,
    ) -> list[CallResult]:
        """Run ``method(samples, **options)`` on every worker of ``component`` at once
        (SPMD: a trainer step, a checksum, a weight sync); results by device.

        Waits for a migration of the component in progress to end. Raises RemoteError
        when a worker's method fails, DeadlineExceeded after ``deadline_s`` (default
        ``RuntimeConfig.request_timeout_s``), ValueError for an unknown component.
        """
        manager = self._controller.manager(component)
        return await manager.call(method, samples, dict(options), deadline_s=deadline_s)

    def set_remaining(self, component: str, items: int | None) -> None:
        """Tell the scheduler how many items ``component`` still has to process in this
        iteration (None: its workers' and dispatcher's own figures)."""
        self._controller.manager(component).remaining = items

    def new_iteration(self) -> int:
        """Mark an iteration boundary (completed counts start over); the new number."""
        self._iteration += 1
        for manager in self._controller.managers.values():
            manager.new_iteration(self._iteration)
        return self._iteration

    # ------------------------------------------------------------------ moves

    async def move(
        self, devices: Sequence[int], *, src: str, dst: str, lease_s: float | None = None
    ) -> MoveOutcome:
        """Move ``devices`` from ``src`` to ``dst`` now (an operator's move), each
        migration under a lease of ``lease_s`` seconds (default: the configured one).

        Returns its outcome (``ok`` False after a rollback); raises ValueError when
        ``src`` does not hold the devices.
        """
        current = self.allocation
        return await self.reallocate(current.move(devices, src, dst), lease_s=lease_s)

    async def reallocate(
        self,
        allocation: Allocation | Mapping[str, Sequence[int]],
        *,
        lease_s: float | None = None,
    ) -> MoveOutcome:
        """Move to ``allocation`` now (every changed component migrates); its outcome."""
        new = allocation if isinstance(allocation, Allocation) else Allocation.of(allocation)
        old = self.allocation
        moves = tuple(
            DeviceMove(src=name, dst=None, devices=tuple(set(old.devices(name)) - set(devs)))
            for name, devs in new.assignment
            if set(old.devices(name)) - set(devs)
        )
        command = MigrationCommand(
            decision_id=f"op{next(self._ids):06d}",
            time=self._controller.scheduler.clock.now(),
            old_allocation=old,
            new_allocation=new,
            moves=moves,
        )
        outcome = await self._controller.coordinator.execute(command, lease_s=lease_s)
        # Not the scheduler's command: it takes the allocation as in force, ends no move of its own.
        self._controller.post(replace(outcome, external=True))
        return outcome

    def operator(self, action: str, reason: str = "operator") -> None:
        """Steer the scheduler: ``enter_safe_mode``, ``leave_safe_mode``, ``observe_only``
        or ``act``."""
        if action not in ("enter_safe_mode", "leave_safe_mode", "observe_only", "act"):
            raise ValueError(f"unknown operator action {action!r}")
        self._controller.post(OperatorCommand(action=action, reason=reason))  # type: ignore[arg-type]


def _recovered(components: Sequence[ComponentSpec], journal: Journal) -> list[ComponentSpec]:
    """``components`` on the allocation ``journal`` last committed (and a migration it
    holds in flight journalled as rolled back)."""
    state = journal.state
    if state.in_flight is not None:
        reason = "the controller restarted before its commit point"
        journal.end_migration(state.in_flight.migration_id, "rolled_back", reason)
        logger.warning(
            "journal: migration %s rolled back (%s)", state.in_flight.migration_id, reason
        )
    if state.allocation is None:
        return list(components)
    allocation = state.allocation
    logger.info("journal: recovered allocation %s (epoch %d)", allocation.as_dict(), state.epoch)
    return [dataclasses.replace(s, devices=allocation.devices(s.name)) for s in components]
