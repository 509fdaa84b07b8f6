"""The worker agent: one process per device, hosting roles and answering the controller.

The agent registers with the controller's bus server as ``worker/<device>`` (the caller
imports torch and the role modules first, so start-up never looks like a lost peer) and
serves, on its event loop:

- runtime requests in an ``Envelope`` (:mod:`dynarl.runtime._worker_protocol`): activate or
  deactivate roles, call role methods, abort in-flight work, P2P reshard steps, reboot
  checkpoints, shutdown;
- ``GenerationRequest`` / ``Sample`` requests: served by the active role's ``serve``.

Compute runs on the one :class:`~dynarl.runtime.worker.ComputeThread`, so heartbeats and
commands are always answered. Every ``metrics_interval_s`` the agent sends the active
role's ``WorkerMetrics`` to the manager endpoint of its component (never to the
controller's socket). It leaves when told to (``Shutdown``), on SIGTERM, when the
controller is lost, or when the active role's engine died
(:class:`~dynarl.errors.EngineLostError` from its ``serve`` or ``run``): a worker without
its engine serves nothing, so it leaves, the controller sees the worker gone and its
in-flight requests continue elsewhere (the one that met the dead engine gets no reply:
it fails at the controller with the worker's loss, not counted against the item).

A worker that lost its controller closes its roles as usual, but with a deadline: behind a
network partition a close that touches the job's store or a peer (a group's rendezvous
key, a collective) would wait on TCP for many minutes. After ``collective_timeout_s`` the
process exits with status 1 whatever is still running: nothing it holds can reach the job
any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from dynarl.bus import (
    BusClient,
    BusConfig,
    CurveClient,
    Envelope,
    GenerationRequest,
    Peer,
    Sample,
    WorkerMetrics,
)
from dynarl.errors import EngineLostError, ProtocolError, WorkerError
from dynarl.runtime._worker_protocol import (
    FINISH,
    AbortInflight,
    Activate,
    Call,
    CallResult,
    Deactivate,
    Done,
    LoadState,
    Reshard,
    RuntimeMessage,
    SaveState,
    Shutdown,
    pack,
    unpack,
)
from dynarl.runtime.durable import load_rng_file, save_rng_file
from dynarl.runtime.worker._host import RoleHost
from dynarl.runtime.worker._options import WorkerOptions
from dynarl.runtime.worker._rank_migrations import RankMigrations
from dynarl.runtime.worker._role import (
    Checkpointing,
    ComputeThread,
    Reporting,
    RoleContext,
    RoleMetrics,
    Serving,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["WorkerAgent"]

logger = logging.getLogger(__name__)

_HOOKS = frozenset(
    {"run", "interrupt", "start", "sleep", "wake", "close", "serve", "abort", "metrics"}
    | {"layout", "shard_views", "allocate", "commit", "discard", "save_state", "load_state"}
)
"""Role methods the runtime calls itself; a ``Call`` may not name them."""


class WorkerAgent:
    """The agent of one worker process (see the module docstring)."""

    def __init__(
        self,
        options: WorkerOptions,
        *,
        store: Store | None = None,
        curve: CurveClient | None = None,
    ) -> None:
        """``store``: the job's store when the launcher already holds it (torchrun),
        else a client of ``options.store_host:store_port`` is opened on first use;
        ``curve``: CURVE settings when the controller binds a routable address."""
        self.options = options
        self.device = options.device
        self._compute = ComputeThread(f"dynarl-compute-{options.device}")
        self._stop = asyncio.Event()
        self._lost = False
        self._engine_lost: EngineLostError | None = None
        self._store: Store | None = store
        self._store_lock = threading.Lock()
        self._in_flight = 0
        self._completed = 0
        self._shared: dict[str, Any] = {}
        self._metrics: tuple[str, BusClient] | None = None
        self._curve = curve
        self._client = BusClient(
            options.controller,
            name=f"worker/{options.device}",
            config=BusConfig(register_timeout_s=options.register_timeout_s),
            role="worker",
            worker=options.device,
            devices=(options.device,),
            on_lost=self._on_lost,
            curve=curve,
        )
        self._client.route(Envelope, self._on_envelope)
        self._client.route(GenerationRequest, self._serve)
        self._client.route(Sample, self._serve)

    def _on_lost(self) -> None:
        logger.error("worker %d: controller lost; leaving", self.device)
        self._lost = True
        self._stop.set()
        grace_s = self.options.collective_timeout_s
        watchdog = threading.Timer(grace_s, self._exit_unclosed, args=(grace_s,))
        watchdog.daemon = True
        watchdog.start()

    def _exit_unclosed(self, grace_s: float) -> None:
        """The close after a lost controller did not end in ``grace_s``: exit now."""
        logger.error(
            "worker %d: closing did not end %.1f s after the controller was lost (a store or "
            "peer behind a partition); exiting", self.device, grace_s,
        )  # fmt: skip
        logging.shutdown()
        os._exit(1)

    def _leave_without_engine(self, exc: EngineLostError) -> None:
        if self._engine_lost is None:
            logger.error("worker %d: leaving the job: %s", self.device, exc)
            self._engine_lost = exc
            self._client.leave_reason = f"its engine died: {exc}"
        self._stop.set()

    async def run(self) -> int:
        """Serve until shutdown; returns the exit status (1 if the controller was lost, 3
        if the active role's engine died).

        Raises DeadlineExceeded or ProtocolError if registration fails.
        """
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        try:
            async with asyncio.TaskGroup() as group:
                self._host = RoleHost(
                    self.device, group, self._context, on_engine_lost=self._leave_without_engine
                )
                self._ranks = RankMigrations(
                    device=self.device,
                    host=self._host,
                    compute=self._compute,
                    store=self._get_store,
                    group=group,
                    timeout_s=self.options.collective_timeout_s,
                )
                async with self._client:
                    reporter = group.create_task(self._report())
                    await self._stop.wait()
                    reporter.cancel()
                    self._ranks.close()
                    await self._host.close()
                await self._close_metrics()
        finally:
            self._compute.close()
        logger.info("worker %d: left the job", self.device)
        if self._engine_lost is not None:
            return 3
        return 1 if self._lost else 0

    # ------------------------------------------------------------------ context

    def _context(self, command: Activate) -> RoleContext:
        return RoleContext(
            component=command.component,
            device=self.device,
            devices=command.devices,
            options=command.options,
            epoch=command.epoch,
            compute=self._compute,
            store=self._get_store,
            backend=self._client,
            shared=self._shared,
            cpus=self.options.cpus,
        )

    def _get_store(self) -> Store:
        with self._store_lock:
            return self._connect_store()

    def _connect_store(self) -> Store:
        if self._store is None:
            from torch._C._distributed_c10d import TCPStore

            if not self.options.store_port:
                raise WorkerError(f"worker {self.device} was started without a store address")
            self._store = TCPStore(
                self.options.store_host,
                self.options.store_port,
                is_master=False,
                timeout=timedelta(seconds=self.options.store_timeout_s),
            )
        return self._store

    # ------------------------------------------------------------------ requests

    async def _on_envelope(self, envelope: Envelope, peer: Peer) -> Envelope:
        return pack(await self._dispatch(unpack(envelope)))

    async def _dispatch(self, message: RuntimeMessage) -> RuntimeMessage:
        match message:
            case Activate():
                return await self._host.activate(message)
            case Deactivate():
                return await self._host.deactivate(message.component, keep=message.keep)
            case Call():
                return await self._call(message)
            case AbortInflight():
                await self._serving(message.component).abort()
                return Done()
            case Reshard():
                return await self._ranks.step(message)
            case SaveState() | LoadState():
                role = self._host.role(message.component)
                if not isinstance(role, Checkpointing):
                    return Done(detail="stateless role: nothing to save or load")
                save = isinstance(message, SaveState)
                await self._compute.run(role.save_state if save else role.load_state, message.path)
                rng = save_rng_file if save else load_rng_file  # the RNG goes with the state
                await self._compute.run(rng, message.path, self.device)
                return Done()
            case Shutdown():
                logger.info("worker %d: shutdown (%s)", self.device, message.reason)
                self._stop.set()
                return Done()
        raise ProtocolError(f"invalid: a worker does not serve {type(message).__name__}")

    def _serving(self, component: str) -> Serving:
        role = self._host.role(component)
        if not isinstance(role, Serving):
            raise WorkerError(f"{component} role does not serve requests")
        return role

    async def _serve(self, item: GenerationRequest | Sample, peer: Peer) -> Sample:
        if self._engine_lost is not None:  # leaving: no reply (see the module docstring)
            await asyncio.Event().wait()
        active = self._host.active
        if active is None:
            raise WorkerError(f"worker {self.device} has no active role")
        role = self._serving(active)
        self._in_flight += 1
        try:
            result = await role.serve(item)
        except EngineLostError as exc:
            self._leave_without_engine(exc)
            await asyncio.Event().wait()  # no reply: cancelled as the worker leaves
            raise
        finally:
            self._in_flight -= 1
        if result.metadata.get(FINISH) != "abort":
            self._completed += 1
        return result

    async def _call(self, message: Call) -> CallResult:
        role = self._host.role(message.component)
        name = message.method
        if name.startswith("_") or name in _HOOKS or not hasattr(type(role), name):
            raise WorkerError(f"{message.component} role has no callable method {name!r}")
        method = getattr(role, name)
        if inspect.iscoroutinefunction(method):
            out = await method(message.samples, **message.options)
        else:
            out = await self._compute.run(method, message.samples, **message.options)
        return _call_result(self.device, out)

    # ------------------------------------------------------------------ metrics

    async def _report(self) -> None:
        interval = self.options.metrics_interval_s
        last, busy, done = time.perf_counter(), self._compute.busy_seconds(), self._completed
        while True:
            await asyncio.sleep(interval)
            now, busy_now = time.perf_counter(), self._compute.busy_seconds()
            span, used, finished = now - last, busy_now - busy, self._completed - done
            last, busy, done = now, busy_now, self._completed
            active = self._host.active
            address = self._host.manager(active) if active is not None else ""
            if active is None or not address:
                continue
            address = reachable(address, via=self.options.controller)
            role = self._host.role(active)
            if isinstance(role, Reporting):
                figures = role.metrics()
            else:
                figures = RoleMetrics(
                    utilization=min(1.0, used / span),
                    in_flight=self._in_flight,
                    completed=finished,
                )
            try:
                client = await self._metrics_client(active, address)
            except Exception as exc:  # the loop's boundary: try again next interval
                logger.warning("worker %d: no manager for %s: %r", self.device, active, exc)
                continue
            client.notify(_worker_metrics(active, self.device, span, figures))

    async def _metrics_client(self, component: str, address: str) -> BusClient:
        if self._metrics is not None:
            if self._metrics[0] == address and not self._metrics[1].lost:
                return self._metrics[1]
            await self._close_metrics()
        client = BusClient(
            address,
            curve=self._curve,
            name=f"{component}/{self.device}",
            config=BusConfig(register_timeout_s=self.options.register_timeout_s),
            role="worker",
            component=component,
            worker=self.device,
            devices=(self.device,),
        )
        await client.start()
        self._metrics = (address, client)
        return client

    async def _close_metrics(self) -> None:
        if self._metrics is not None:
            _, client = self._metrics
            self._metrics = None
            await client.aclose()


_WILDCARDS = ("0.0.0.0", "*", "[::]", "::")


def reachable(address: str, *, via: str) -> str:
    """``address`` as this worker can reach it: an endpoint the controller bound on every
    interface (``tcp://0.0.0.0:P``) is at the host this worker reaches the controller on
    (``via``); any other address is returned as it is."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if host not in _WILDCARDS:
        return address
    via_host = via.partition("://")[2].rpartition(":")[0]
    return f"{scheme}://{via_host}:{port}"


def _worker_metrics(component: str, device: int, span: float, m: RoleMetrics) -> WorkerMetrics:
    return WorkerMetrics(
        component=component,
        worker=device,
        time=time.monotonic(),
        interval_s=span,
        utilization=m.utilization,
        queue_depth=m.queue_depth,
        completed=m.completed,
        in_flight=m.in_flight,
        interruptible=m.interruptible,
        cache_hit_rate=m.cache_hit_rate,
    )


def _call_result(device: int, out: Any) -> CallResult:
    if out is None:
        return CallResult(device=device)
    if isinstance(out, Mapping):
        return CallResult(device=device, values=dict(out))
    if isinstance(out, Sequence) and all(isinstance(s, Sample) for s in out):
        return CallResult(device=device, samples=tuple(out))
    raise WorkerError(f"a role method must return None, a mapping or samples, not {type(out)}")
