"""The controller: the job's TCPStore, bus, scheduler, coordinator, managers and ledger.

One process (the driver locally, rank 0 under torchrun) hosts, on one event loop:

- the job's **TCPStore** (workers build process groups over ``PrefixStore`` s of it);
- the **bus server** workers register with (``worker/<device>``), which also hosts the
  channel queues (serving components put their results there);
- a **publisher** of reports, migration records and peer events;
- one **group manager** per component, each with its own metrics endpoint;
- the **scheduler** coroutine on the real monotonic clock, fed with the managers'
  reports, ticks and move outcomes (whatever is queued, as one batch), writing every
  decision to the **ledger**;
- the **coordinator**, the scheduler's command sink, with a
  :class:`~dynarl.runtime.controller.PlannerCost` injected into the scheduler;
- in its tick, the **loss handler** (``_reclaim.py``): a worker that dies outside a
  migration is a device the job loses, reclaimed through the scheduler's quota path, or
  the job stops with one WorkerLostError;
- when ``RuntimeConfig.metrics_port`` is set, the **Prometheus endpoint**
  (:class:`~dynarl.runtime.controller.MetricsExporter`, loopback by default).

Use as ``async with Controller(...) as controller``; workers are started by someone else
(the local launcher, torchrun). Runs on the controller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynarl._resource import AsyncResource, background, stage
from dynarl.bus import (
    BusConfig,
    BusServer,
    Channel,
    ComponentReport,
    CurveServer,
    MigrationRecord,
    PeerEvent,
    Publisher,
    Sample,
)
from dynarl.errors import BusError, DynarlError, WorkerError
from dynarl.runtime._faults import FaultInjector
from dynarl.runtime._spec import ComponentSpec, RuntimeConfig, pipeline_graph
from dynarl.runtime._store import host_store
from dynarl.runtime._worker_protocol import Done, Shutdown
from dynarl.runtime.controller._coordinator import Coordinator
from dynarl.runtime.controller._durability import AllocationJournal
from dynarl.runtime.controller._group_manager import GroupManager
from dynarl.runtime.controller._link import WorkerLink
from dynarl.runtime.controller._losses import GuardedChannels
from dynarl.runtime.controller._planner_cost import PlannerCost
from dynarl.runtime.controller._prometheus import MetricsExporter, metrics_available
from dynarl.runtime.controller._reclaim import LossHandler, num_kills
from dynarl.sched import (
    Ledger,
    MonotonicClock,
    RegressionPredictor,
    Scheduler,
    SchedulerEvent,
    ThroughputPredictor,
    Tick,
    queued_batches,
)
from dynarl.types import Allocation

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["Controller"]

logger = logging.getLogger(__name__)


class Controller(AsyncResource):
    """The job's controller (see the module docstring).

    ``store``: the job's store when a launcher already holds one (torchrun), else the
    controller hosts a TCPStore on loopback; ``bind`` and ``curve``: the bus server's
    address and CURVE settings (required for a routable address); ``predictor``: the
    scheduler's throughput predictor (None: a
    :class:`~dynarl.sched.RegressionPredictor` over the components' profiles);
    ``first_decision``: the number of the scheduler's first decision (a restarted
    controller's continue past its journal's). Raises ValueError for components with
    clashing names or devices.

    Entering opens, in this order, the store, the publisher, the bus server and the
    managers' endpoints, the ledger, the metrics endpoint, then starts the loops; a stage
    that fails raises an error whose message names it (``start-up failed at stage
    'bus bind': ...``, chained to the cause): WorkerError for ``store``, BusError for
    ``publisher`` and ``bus bind``, DynarlError for ``metrics port``. Whatever opened
    before is closed first, in reverse order, as leaving closes everything.
    """

    def __init__(
        self,
        specs: Sequence[ComponentSpec],
        *,
        num_devices: int,
        run_dir: Path,
        config: RuntimeConfig | None = None,
        kill: Callable[[int], None] | None = None,
        journal: AllocationJournal | None = None,
        store: Store | None = None,
        bind: str = "tcp://127.0.0.1:0",
        curve: CurveServer | None = None,
        predictor: ThroughputPredictor | None = None,
        first_decision: int = 1,
    ) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique, got {names}")
        self.specs = {spec.name: spec for spec in specs}
        self._graph = pipeline_graph(specs)
        self.config = config or RuntimeConfig()
        self.run_dir = run_dir
        initial = Allocation.of({spec.name: spec.devices for spec in specs})
        held = {d for _, devs in initial.assignment for d in devs}
        if held and max(held) >= num_devices:
            raise ValueError(f"components use device {max(held)} of only {num_devices}")
        self.num_devices = num_devices
        self._initial = initial
        self._kill, self._journal = kill, journal
        self._given_store, self._bind, self._curve = store, bind, curve
        self._predictor = predictor
        self._first_decision = first_decision
        self._events: asyncio.Queue[SchedulerEvent | None] = asyncio.Queue()
        self._stop = asyncio.Event()
        self.metrics: MetricsExporter | None = None
        self.bus = BusConfig(
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            num_missed_heartbeats=self.config.num_missed_heartbeats,
            default_timeout_s=self.config.request_timeout_s,
            channel_capacity=self.config.channel_capacity,
        )

    # ------------------------------------------------------------------ life cycle

    async def _open(self, stack: AsyncExitStack) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with stage("store", WorkerError):
            self.store: Store = self._given_store or host_store(
                "127.0.0.1", 0, timeout_s=self.config.collective_timeout_s
            )
        stack.callback(self._release_store)
        # The publisher before the server, so it outlives every peer event the server emits.
        with stage("publisher", BusError):
            self.publisher = await stack.enter_async_context(Publisher(config=self.bus))
        with stage("bus bind", BusError):
            self.server = await stack.enter_async_context(
                BusServer(
                    self._bind,
                    name="controller",
                    config=self.bus,
                    curve=self._curve,
                    on_peer=self._on_peer,
                )
            )
        self.link = WorkerLink(self.server, timeout_s=self.config.request_timeout_s)
        self.ledger = Ledger(
            self.run_dir / "events.jsonl", keep_recent=self.config.ledger_keep_recent
        )
        stack.callback(self.ledger.close)
        clock = MonotonicClock()
        self.managers = {
            name: GroupManager(
                spec,
                link=self.link,
                config=self.config,
                bus=self.bus,
                clock=clock,
                report=self._on_report,
                output=self._sink(spec),
                run_dir=self.run_dir,
                bind=f"{self._bind.rpartition(':')[0]}:0",  # the bus's host, any port
                curve=self._curve,
            )
            for name, spec in self.specs.items()
        }
        with stage("bus bind", BusError):
            for manager in self.managers.values():
                await manager.start()
                stack.push_async_callback(manager.aclose)
        self._build_scheduler(clock)
        self.coordinator.journal.start(self._initial)
        await self._open_metrics(stack)
        # Runs once the loops below have stopped, while the bus is still open.
        stack.push_async_callback(self._shutdown_workers)
        tasks = await stack.enter_async_context(background())
        stack.callback(self._signal_stop)
        for manager in self.managers.values():
            tasks.create_task(manager.run(self._stop))
        tasks.create_task(self.coordinator.run())
        tasks.create_task(self.scheduler.run(queued_batches(self._events), self.coordinator))
        tasks.create_task(self._tick())
        logger.info("controller listening on %s", self.address)

    async def _open_metrics(self, stack: AsyncExitStack) -> None:
        port = self.config.metrics_port
        if port == 0 and not metrics_available():
            logger.warning("no metrics endpoint: pip install 'dynarl[metrics]' for one")
        elif port is not None:
            exporter = MetricsExporter(self.scheduler, host=self.config.metrics_host, port=port)
            with stage("metrics port", DynarlError):
                await stack.enter_async_context(exporter)
            self.metrics = exporter

    def _signal_stop(self) -> None:
        self._stop.set()
        self._events.put_nowait(None)

    def _release_store(self) -> None:
        # A store the controller made closes its server when the last reference goes.
        del self.store

    def _build_scheduler(self, clock: MonotonicClock) -> None:
        profiles = {n: s.profile for n, s in self.specs.items() if s.profile is not None}
        layouts = {n: f for n, s in self.specs.items() if (f := s.plan_layout()) is not None}
        self.cost = PlannerCost(layouts, bytes_per_s=self.config.transfer_bytes_per_s)
        held = {d for _, devs in self._initial.assignment for d in devs}
        self.scheduler = Scheduler(
            graph=self._graph,
            allocation=self._initial,
            predictor=(
                self._predictor if self._predictor is not None else RegressionPredictor(profiles)
            ),
            cost=self.cost,
            clock=clock,
            config=self.config.scheduler,
            ledger=self.ledger,
            free=[d for d in range(self.num_devices) if d not in held],
            first_decision=self._first_decision,
        )
        self.faults = FaultInjector(self.config.faults, kill=self._kill)
        self.coordinator = Coordinator(
            managers=self.managers,
            specs=self.specs,
            allocation=self._initial,
            config=self.config,
            faults=self.faults,
            clock=clock,
            cost=self.cost,
            outcomes=self._events.put_nowait,
            publish=self._on_record,
            journal=self._journal,
        )

    async def aclose(self) -> None:
        """Stop the loops, tell every worker to leave, close every socket, the ledger and
        the store, in reverse order of opening (idempotent)."""
        await super().aclose()

    async def _shutdown_workers(self) -> None:
        devices = sorted(self.link.registered())
        replies = await asyncio.gather(
            *[self.link.ask(d, Shutdown(reason="job ends"), Done, deadline_s=5.0) for d in devices],
            return_exceptions=True,
        )
        for device, reply in zip(devices, replies, strict=True):
            if isinstance(reply, BaseException):
                logger.info("worker %d did not acknowledge shutdown: %r", device, reply)

    # ------------------------------------------------------------------ public

    @property
    def address(self) -> str:
        """The bus address workers connect to."""
        return self.server.address

    @property
    def store_port(self) -> int:
        """Port of the job's TCPStore (on 127.0.0.1) when the controller hosts it."""
        port: int = getattr(self.store, "port", 0)
        return port

    @property
    def allocation(self) -> Allocation:
        """The allocation in force."""
        return self.coordinator.allocation

    async def wait_for_workers(self, devices: Sequence[int], *, alive: Callable[[], None]) -> None:
        """Wait until every device's worker registered; ``alive()`` raises if one died.

        Raises TimeoutError after ``config.start_timeout_s``.
        """
        async with asyncio.timeout(self.config.start_timeout_s):
            while not set(devices) <= self.link.registered():
                alive()
                await asyncio.sleep(0.05)

    async def start_roles(self) -> None:
        """Activate every component on its initial devices."""
        await asyncio.gather(*[m.start_roles() for m in self.managers.values()])

    def manager(self, component: str) -> GroupManager:
        """The manager of ``component``; ValueError if there is none."""
        try:
            return self.managers[component]
        except KeyError:
            raise ValueError(f"no component named {component!r}") from None

    def channel(self, name: str, *, capacity: int | None = None) -> Channel[Sample]:
        """The ``Sample`` channel ``name``, bound to the queues this controller hosts
        (its operations raise the job's fatal WorkerLostError once it cannot go on)."""
        size = capacity or self.config.channel_capacity
        backend = GuardedChannels(self.server.channels, self.link.losses)
        return Channel(name, Sample, capacity=size).bind(backend)

    async def settled(self) -> None:
        """Return once every worker death seen so far (and any found by probing now) is
        handled: its device reclaimed, or the job failed.

        Raises the fatal WorkerLostError when the job cannot go on, TimeoutError after
        ``lease_s + request_timeout_s``.
        """
        losses = self.link.losses
        asked = losses.ask()
        async with asyncio.timeout(self.config.lease_s + self.config.request_timeout_s):
            await losses.settled(asked)
        losses.raise_if_failed()

    def post(self, event: SchedulerEvent) -> None:
        """Hand the scheduler an event (a move outcome of a move made outside it)."""
        self._events.put_nowait(event)

    # ------------------------------------------------------------------ internals

    def _sink(self, spec: ComponentSpec) -> Callable[[Sample], Coroutine[Any, Any, None]]:
        async def put(sample: Sample) -> None:
            await self.server.channels.channel_put(
                spec.output_channel,
                "",
                sample,
                capacity=self.config.channel_capacity,
                timeout=None,
            )

        return put

    async def _tick(self) -> None:
        """A Tick for the scheduler every decision interval; a judging round over the
        workers as often, and at once when one is named suspect (``LossHandler``)."""
        losses = self.link.losses
        handler = LossHandler(
            link=self.link,
            managers=self.managers,
            scheduler=self.scheduler,
            coordinator=self.coordinator,
            faults=self.faults,
            post=self.post,
        )
        interval = self.config.scheduler.decision_interval_s
        loop = asyncio.get_running_loop()
        due = loop.time() + interval
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, due - loop.time())):
                    await losses.changed.wait()
            losses.changed.clear()
            await handler.round()
            if loop.time() >= due:
                self._events.put_nowait(Tick())
                due = loop.time() + interval

    def _on_report(self, report: ComponentReport) -> None:
        self._events.put_nowait(report)
        self.publisher.publish(f"report/{report.component}", report)

    def _on_record(self, record: MigrationRecord) -> None:
        self.publisher.publish(f"migration/{record.component}", record)

    def _on_peer(self, event: PeerEvent) -> None:
        if event.event == "lost":
            logger.warning("peer %s lost", event.peer)
        self._note_worker(event)
        if self.metrics is not None:
            self.metrics.peer_event(event.event)
        if getattr(self, "publisher", None) is not None:
            self.publisher.publish("peer", event)

    def _note_worker(self, event: PeerEvent) -> None:
        """A worker registered (record its process), or was lost or left outside the
        job's end (a suspect, judged on the next turn of the tick)."""
        prefix, _, tail = event.peer.partition("/")
        link: WorkerLink | None = getattr(self, "link", None)
        if prefix != "worker" or not tail.isdigit() or link is None:
            return
        device = int(tail)
        if event.event == "registered":
            peer = self.server.peer(event.peer)
            if peer is not None and peer.info is not None:
                kills = num_kills(self.faults, device) if hasattr(self, "faults") else 0
                link.losses.registered(device, pid=peer.info.pid, host=peer.info.host, kills=kills)
        elif not self._stop.is_set():
            seen = "missed heartbeats" if event.event == "lost" else "left the job"
            if event.event == "left" and event.reason not in ("", "closed"):
                seen = f"{seen} ({event.reason})"
            link.losses.suspect(device, cause=seen)
