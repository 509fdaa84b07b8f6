"""The controller's Prometheus endpoint (the ``metrics`` extra: ``prometheus-client``).

:class:`MetricsExporter` keeps its own registry (never the process-global one) with:

- **gauges read at scrape time** from the scheduler: ``dynarl_allocation_devices``
  and ``dynarl_free_devices``; per component ``dynarl_queue_depth``,
  ``dynarl_utilization`` (window mean), ``dynarl_throughput_items_per_second`` (window
  mean), ``dynarl_remaining_items``, ``dynarl_workers`` and the predictor's
  ``dynarl_prediction_error_ratio`` (median relative error of recent predictions);
  ``dynarl_safe_mode``, ``dynarl_observe_only``, ``dynarl_move_in_flight``,
  ``dynarl_consecutive_failed_moves``;
- **counters and histograms fed by the ledger** (a listener, so every record is counted
  once, whatever reads the ledger): ``dynarl_decision_rounds_total{result}``,
  ``dynarl_rejected_candidates_total``, ``dynarl_migrations_total{kind,component,outcome}``,
  ``dynarl_migration_bytes_total{kind,component}``,
  ``dynarl_migration_pause_seconds{kind}``, ``dynarl_cache_loss_tokens_total{component}``,
  ``dynarl_safe_mode_entries_total``, ``dynarl_move_prediction_error`` (signed, per
  measured move), ``dynarl_move_predicted_gain_seconds_total`` and the gauge
  ``dynarl_move_realised_gain_seconds`` (their sums; a realised gain may be negative);
- ``dynarl_peer_events_total{event}`` (workers registered, lost), fed by the controller;
- the ``dynamic_resource/*`` metrics of a hybrid-scheduling cycle, as gauges
  ``dynarl_dynamic_resource_<name>``, fed by :meth:`MetricsExporter.record_cycle` with
  what :meth:`dynarl.sched.DynamicResourceMetrics.cycle` returns.

The endpoint is a small HTTP/1.0 server on the controller's event loop (``GET /metrics``),
so a scrape reads the scheduler from the loop that changes it — no thread, no lock. It
binds loopback by default; any other host is the operator's explicit choice (logged: the
endpoint has no authentication). Use as ``async with MetricsExporter(...)`` or call
:meth:`start` and :meth:`aclose`. Raises ModuleNotFoundError naming the extra when
``prometheus-client`` is not installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from dynarl._resource import AsyncResource
from dynarl.bus import DecisionRecord, MigrationRecord
from dynarl.sched import LedgerRecord, SafeModeRecord, Scheduler

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.core import Metric

__all__ = ["MetricsExporter", "metrics_available"]

logger = logging.getLogger(__name__)

_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
_PAUSE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ERROR_BUCKETS = (-0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
_REQUEST_TIMEOUT_S = 5.0
_RECENT_ROUNDS = 4096
"""Uncommitted rounds remembered to count a re-appended one once (the scheduler never
re-appends them; committed decisions, whose effects are filled in later, are all kept)."""


def metrics_available() -> bool:
    """Whether the ``metrics`` extra (prometheus-client) is installed."""
    return importlib.util.find_spec("prometheus_client") is not None


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "the metrics endpoint needs prometheus-client: pip install 'dynarl[metrics]'"
        ) from err
    return prometheus_client


class _SchedulerCollector:
    """Gauges read from the scheduler when Prometheus scrapes (on the event loop)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        s = self._scheduler

        def family(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=list(labels))

        devices = family("dynarl_allocation_devices", "Devices a component holds.", ("component",))
        for name in sorted(s.nodes):
            devices.add_metric([name], s.allocation.count(name))
        yield devices
        free = family("dynarl_free_devices", "Devices of the job's quota no component holds.")
        free.add_metric([], len(s.free))
        yield free
        yield from self._components(s, family)
        safety = s.safety
        for name, doc, value in (
            ("dynarl_safe_mode", "1 while the allocation is frozen.", safety.safe),
            ("dynarl_observe_only", "1 while decisions are not carried out.", s.observe_only),
            (
                "dynarl_move_in_flight",
                "1 while a move is carried out.",
                safety.in_flight is not None,
            ),
            ("dynarl_consecutive_failed_moves", "Failed moves in a row.", safety.failures),
        ):
            gauge = family(name, doc)
            gauge.add_metric([], float(value))
            yield gauge

    def _components(self, s: Scheduler, family: Any) -> Iterator[Metric]:
        stats = s.windows.stats()
        fields = (
            ("dynarl_queue_depth", "Items queued at the latest report.", "queue_depth"),
            ("dynarl_utilization", "Mean utilization over the stats window.", "mean_utilization"),
            (
                "dynarl_throughput_items_per_second",
                "Mean throughput over the window.",
                "throughput",
            ),
            ("dynarl_remaining_items", "Items of the iteration not completed.", "remaining"),
            ("dynarl_workers", "Workers in the latest report.", "num_workers"),
        )
        for metric, doc, attr in fields:
            gauge = family(metric, doc, ("component",))
            for name, stat in stats.items():
                gauge.add_metric([name], float(getattr(stat, attr)))
            yield gauge
        error = family(
            "dynarl_prediction_error_ratio",
            "Median relative error of the predictor's recent throughput predictions.",
            ("component",),
        )
        for name in sorted(s.nodes):
            value, count = s.predictor.prediction_error(name)
            if count:
                error.add_metric([name], value)
        yield error


class MetricsExporter(AsyncResource):
    """Prometheus metrics of one controller (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, *, host: str = "127.0.0.1", port: int = 0) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in [0, 65535], got {port}")
        client = _prometheus()
        self.host, self._port = host, port
        self.registry: CollectorRegistry = client.CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(scheduler))
        self._build(client)
        self._seen: set[tuple[str, str]] = set()
        """Committed decisions, migrations and safe-mode records counted (as the ledger,
        which keeps them all)."""
        self._rounds: OrderedDict[str, None] = OrderedDict()
        """The most recent uncommitted rounds counted (a long job has one a second)."""
        self._measured: set[str] = set()
        self._server: asyncio.Server | None = None
        self._requests: set[asyncio.Task[Any]] = set()
        """The connections being answered (cancelled when the endpoint closes)."""
        scheduler.ledger.add_listener(self.observe)
        for record in scheduler.ledger.query():
            self.observe(record)

    def _build(self, client: Any) -> None:
        reg = self.registry
        self.rounds: Counter = client.Counter(
            "dynarl_decision_rounds", "Decision rounds by result.", ["result"], registry=reg
        )
        self.rejected: Counter = client.Counter(
            "dynarl_rejected_candidates", "Candidates evaluated and not committed.", registry=reg
        )
        self.migrations: Counter = client.Counter(
            "dynarl_migrations",
            "Migrations by kind, component and outcome.",
            ["kind", "component", "outcome"],
            registry=reg,
        )
        self.bytes: Counter = client.Counter(
            "dynarl_migration_bytes", "Bytes moved.", ["kind", "component"], registry=reg
        )
        self.pause: Histogram = client.Histogram(
            "dynarl_migration_pause_seconds",
            "Time a component could not progress during a migration.",
            ["kind"],
            buckets=_PAUSE_BUCKETS,
            registry=reg,
        )
        self.cache_loss: Counter = client.Counter(
            "dynarl_cache_loss_tokens", "Prefix-cache tokens lost.", ["component"], registry=reg
        )
        self.safe_entries: Counter = client.Counter(
            "dynarl_safe_mode_entries", "Times safe mode began.", registry=reg
        )
        self.move_error: Histogram = client.Histogram(
            "dynarl_move_prediction_error",
            "Realised over predicted remaining iteration time of a move, minus 1.",
            buckets=_ERROR_BUCKETS,
            registry=reg,
        )
        self.predicted_gain: Counter = client.Counter(
            "dynarl_move_predicted_gain_seconds", "Predicted gain of measured moves.", registry=reg
        )
        self.realised_gain: Gauge = client.Gauge(
            "dynarl_move_realised_gain_seconds",
            "Realised gain of measured moves (may fall: a move can lose time).",
            registry=reg,
        )
        self.peers: Counter = client.Counter(
            "dynarl_peer_events", "Bus peer events by kind.", ["event"], registry=reg
        )
        self._cycle: dict[str, Gauge] = {}
        self._client = client

    # ------------------------------------------------------------------ feeding

    def observe(self, record: LedgerRecord) -> None:
        """Count a ledger record (the ledger calls this on every append)."""
        match record:
            case DecisionRecord():
                self._decision(record)
            case MigrationRecord():
                key = ("migration", record.migration_id)
                if key not in self._seen:
                    self._seen.add(key)
                    self._migration(record)
            case SafeModeRecord():
                key = ("safety", record.record_id)
                if record.safe and key not in self._seen:
                    self.safe_entries.inc()
                self._seen.add(key)
            case _:
                pass

    def _decision(self, record: DecisionRecord) -> None:
        if self._first_sight(record):
            self.rounds.labels(result=_result(record)).inc()
            self.rejected.inc(len(record.rejected))
        error = record.prediction_error
        if error is not None and record.decision_id not in self._measured:
            self._measured.add(record.decision_id)
            if math.isfinite(error):
                self.move_error.observe(error)
            delta = record.realised_iteration_delta_s
            if delta is not None and math.isfinite(record.expected_gain_s):
                self.predicted_gain.inc(max(record.expected_gain_s, 0.0))
                self.realised_gain.inc(-delta)

    def _first_sight(self, record: DecisionRecord) -> bool:
        """Whether ``record`` is the round's first append (not its realised effects)."""
        seen = record.decision_id in self._rounds
        if not record.committed:
            self._rounds[record.decision_id] = None
            while len(self._rounds) > _RECENT_ROUNDS:
                self._rounds.popitem(last=False)
            return not seen
        key = ("decision", record.decision_id)
        seen |= key in self._seen
        self._seen.add(key)
        return not seen

    def _migration(self, record: MigrationRecord) -> None:
        labels = {"kind": record.kind, "component": record.component}
        self.migrations.labels(outcome=record.outcome, **labels).inc()
        self.bytes.labels(**labels).inc(record.bytes_moved)
        self.pause.labels(kind=record.kind).observe(record.pause_s)
        self.cache_loss.labels(component=record.component).inc(record.cache_loss_tokens)

    def peer_event(self, event: str) -> None:
        """Count a bus peer event (``registered``, ``lost``, ...)."""
        self.peers.labels(event=event).inc()

    def record_cycle(self, metrics: Mapping[str, float]) -> None:
        """Set the ``dynamic_resource/*`` gauges from one cycle's metrics.

        Raises ValueError for a name outside ``dynamic_resource/``.
        """
        for name, value in metrics.items():
            prefix, _, rest = name.partition("/")
            if prefix != "dynamic_resource" or not rest:
                raise ValueError(f"not a dynamic_resource/* metric: {name!r}")
            metric = "dynarl_dynamic_resource_" + re.sub(r"[^a-zA-Z0-9_]", "_", rest)
            gauge = self._cycle.get(metric)
            if gauge is None:
                gauge = self._cycle[metric] = self._client.Gauge(
                    metric, f"{name} of the last hybrid-scheduling cycle.", registry=self.registry
                )
            gauge.set(float(value))

    # ------------------------------------------------------------------ serving

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._server is None:
            return self._port
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        """Where Prometheus scrapes (after :meth:`start`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def start(self) -> None:
        """Bind the endpoint (port 0: a free one). Raises OSError when it cannot bind,
        RuntimeError if it was already started."""
        await self._open_resource()

    async def _open(self, stack: AsyncExitStack) -> None:
        if self.host not in _LOOPBACK:
            logger.warning("metrics endpoint on %s: reachable beyond this machine", self.host)
        self._server = await asyncio.start_server(self._handle, self.host, self._port)
        stack.push_async_callback(self._close_server, self._server)
        logger.info("metrics at %s", self.url)

    async def _close_server(self, server: asyncio.Server) -> None:
        self._server = None
        server.close()
        requests = list(self._requests)
        for task in requests:
            task.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        await server.wait_closed()

    async def aclose(self) -> None:
        """Stop serving (idempotent)."""
        await super().aclose()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._requests.add(task)
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
                writer.write(self._respond(head))
                await writer.drain()
        except (
            TimeoutError,
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            pass
        finally:
            self._requests.discard(task)
            writer.close()

    def _respond(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        method, target = [*lines[0].split(), "", ""][:2]
        headers = dict(
            (k.strip().lower(), v.strip()) for k, _, v in (h.partition(":") for h in lines[1:] if h)
        )
        if method not in ("GET", "HEAD"):
            return _reply("405 Method Not Allowed", "text/plain", b"GET /metrics\n")
        if target.split("?")[0] not in ("/metrics", "/"):
            return _reply("404 Not Found", "text/plain", b"GET /metrics\n")
        encoder, content_type = self._client.exposition.choose_encoder(headers.get("accept", ""))
        body: bytes = encoder(self.registry)
        return _reply("200 OK", content_type, b"" if method == "HEAD" else body, len(body))


def _result(record: DecisionRecord) -> str:
    if record.committed:
        return "committed"
    family = record.reason.family
    return family if family in ("hold", "rejected", "observe-only") else "other"


def _reply(status: str, content_type: str, body: bytes, length: int | None = None) -> bytes:
    head = (
        f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
