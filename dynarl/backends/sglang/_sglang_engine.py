"""One SGLang server as a dynarl rollout engine.

:class:`SGLangEngine` adds to the raw client what dynarl relies on: it keeps track of the
memory it released (resuming a tag SGLang did not release kills the server), waits for the
server to be idle before releasing memory (SGLang asserts idleness and dies otherwise; after
an abort, requests need one more scheduler iteration to leave), reports each finished
request's reusable prefix (``meta_info.cached_tokens``) to an injected sink for the
scheduler's priority queue, and turns ``/v1/loads`` into :class:`~dynarl.bus.WorkerMetrics`.

An aborted request's partial output is continued elsewhere by the runtime's dispatcher
(``dynarl.runtime.controller``), the one re-dispatch path. Runs on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from dynarl.backends.sglang._client import SGLangClient
from dynarl.backends.sglang._http_wire import (
    MEMORY_TAGS,
    GenerateRequest,
    GenerateResult,
    LoadsReply,
    PauseMode,
)
from dynarl.bus import ComponentReport, WorkerMetrics
from dynarl.errors import BackendError
from dynarl.types import ComponentKind

__all__ = [
    "CachedTokensSink",
    "SGLangEngine",
    "rollout_report",
    "worker_metrics",
]

logger = logging.getLogger(__name__)


class CachedTokensSink(Protocol):
    """Receives each finished request's reusable prefix (the scheduler's priority key)."""

    def __call__(self, engine_id: str, request: GenerateRequest, result: GenerateResult) -> None:
        """Called on the engine's loop once per finished (or aborted) request."""


def worker_metrics(
    loads: LoadsReply,
    *,
    component: str,
    worker: int,
    time: float,
    interval_s: float,
    completed: int = 0,
    interruptible: bool = True,
) -> WorkerMetrics:
    """``/v1/loads`` → one worker's metrics; DP ranks are summed (utilization pooled).

    Utilization is KV tokens in use over KV capacity (SGLang's ``token_usage``), queue depth
    the waiting requests, in-flight the running ones, and the cache hit rate the
    token-weighted mean of the ranks' last prefill hit rates.
    """
    ranks = loads.loads
    capacity = sum(rank.max_total_num_tokens for rank in ranks)
    used = sum(rank.num_used_tokens for rank in ranks)
    if capacity > 0:
        utilization = used / capacity
    else:
        utilization = sum(rank.token_usage for rank in ranks) / len(ranks) if ranks else 0.0
    weights = [max(rank.max_total_num_tokens, 1) for rank in ranks]
    hit_rate = (
        sum(rank.cache_hit_rate * w for rank, w in zip(ranks, weights, strict=True)) / sum(weights)
        if ranks
        else 0.0
    )
    return WorkerMetrics(
        component=component,
        worker=worker,
        time=time,
        interval_s=interval_s,
        utilization=min(max(utilization, 0.0), 1.0),
        queue_depth=sum(rank.num_waiting_reqs for rank in ranks),
        completed=completed,
        in_flight=sum(rank.num_running_reqs for rank in ranks),
        interruptible=interruptible,
        cache_hit_rate=hit_rate,
    )


def rollout_report(
    component: str,
    workers: Sequence[WorkerMetrics],
    *,
    time: float,
    interval_s: float,
    remaining: int = 0,
    iteration: int = 0,
) -> ComponentReport:
    """One interval's :class:`~dynarl.bus.ComponentReport` from its engines' metrics.

    Utilization stays per worker (Stage 1 needs it), in worker order; queue depths and
    completions add up; throughput is completions per second. Raises ValueError if the
    metrics belong to another component or repeat a worker.
    """
    if any(metrics.component != component for metrics in workers):
        raise ValueError(f"metrics of another component than {component!r}")
    ordered = sorted(workers, key=lambda metrics: metrics.worker)
    if len({metrics.worker for metrics in ordered}) != len(ordered):
        raise ValueError("one WorkerMetrics per worker")
    completed = sum(metrics.completed for metrics in ordered)
    return ComponentReport(
        component=component,
        kind=ComponentKind.ROLLOUT.value,
        time=time,
        interval_s=interval_s,
        utilization=tuple(metrics.utilization for metrics in ordered),
        queue_depth=sum(metrics.queue_depth for metrics in ordered),
        throughput=completed / interval_s if interval_s > 0 else 0.0,
        completed=completed,
        remaining=remaining,
        interruptible=all(metrics.interruptible for metrics in ordered),
        iteration=iteration,
    )


class SGLangEngine:
    """A rollout engine backed by one SGLang server (see the module docstring).

    ``idle_poll_s`` and ``idle_timeout_s`` bound :meth:`wait_idle`. An async context manager;
    ``aclose()`` closes the client. Runs on one event loop.
    """

    def __init__(
        self,
        client: SGLangClient,
        *,
        engine_id: str,
        on_finished: CachedTokensSink | None = None,
        idle_poll_s: float = 0.05,
        idle_timeout_s: float = 60.0,
    ) -> None:
        if idle_poll_s <= 0 or idle_timeout_s <= 0:
            raise ValueError("idle_poll_s and idle_timeout_s must be > 0")
        self.client = client
        self.engine_id = engine_id
        self.idle_poll_s = idle_poll_s
        self.idle_timeout_s = idle_timeout_s
        self._on_finished = on_finished
        self._released: set[str] = set()
        self._paused: PauseMode | None = None
        self._completed = 0

    async def __aenter__(self) -> SGLangEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client (the server keeps running)."""
        await self.client.aclose()

    @property
    def released_tags(self) -> frozenset[str]:
        """Memory tags released by this engine and not resumed yet."""
        return frozenset(self._released)

    @property
    def paused(self) -> PauseMode | None:
        """The pause mode in force, if this engine paused the server."""
        return self._paused

    # ------------------------------------------------------------------ generation

    def _finished(self, request: GenerateRequest, result: GenerateResult) -> GenerateResult:
        self._completed += 1
        if self._on_finished is not None:
            self._on_finished(self.engine_id, request, result)
        return result

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one request; an abort returns the partial output (``result.aborted``)."""
        return self._finished(request, await self.client.generate(request))

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateResult]:
        """Stream one request's cumulative results; the last one is final."""
        async for result in self.client.generate_stream(request):
            if result.finished:
                self._finished(request, result)
            yield result

    async def abort(self, rid: str) -> None:
        """Abort one request (its caller receives the partial output)."""
        await self.client.abort(rid)

    async def abort_all(self) -> None:
        """Abort every in-flight request."""
        await self.client.abort_all()

    # ------------------------------------------------------------------ control

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Pause generation; new requests wait at the server until :meth:`continue_generation`."""
        await self.client.pause(mode)
        self._paused = mode
        logger.info("engine %s paused (%s)", self.engine_id, mode)

    async def continue_generation(self) -> None:
        """Resume after :meth:`pause`."""
        await self.client.continue_generation()
        self._paused = None
        logger.info("engine %s continued", self.engine_id)

    async def flush_cache(self) -> None:
        """Flush the radix cache; raises BackendError if the server refuses (busy)."""
        result = await self.client.flush_cache()
        if not result.success:
            raise BackendError(f"engine {self.engine_id}: flush_cache refused: {result.message}")

    async def wait_idle(
        self, *, timeout_s: float | None = None, ignore_waiting: bool = False
    ) -> LoadsReply:
        """Poll ``/v1/loads`` until nothing runs (and, unless ``ignore_waiting``, waits).

        Raises BackendError if that does not happen within ``timeout_s`` (default
        ``idle_timeout_s``).
        """
        deadline = timeout_s if timeout_s is not None else self.idle_timeout_s
        try:
            async with asyncio.timeout(deadline):
                while True:
                    loads = await self.client.loads(include="core")
                    if all(
                        rank.num_running_reqs == 0
                        and (ignore_waiting or rank.num_waiting_reqs == 0)
                        for rank in loads.loads
                    ):
                        return loads
                    await asyncio.sleep(self.idle_poll_s)
        except TimeoutError as exc:
            raise BackendError(f"engine {self.engine_id} not idle after {deadline} s") from exc

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Release GPU memory by tag (None: all) once the server is idle.

        SGLang's own idleness rule ignores waiting requests while generation is paused in
        ``retract``/``in_place`` mode, and so does the wait here. A ``retract`` pause returns
        once the running requests are back in the queue, and while it lasts ``/v1/loads``
        still shows the last step's figures (sglang 0.5.23, measured): nothing to wait for
        then. Raises BackendError if the server does not become idle in time (nothing is
        released then).
        """
        wanted = tuple(tags) if tags is not None else MEMORY_TAGS
        if self._paused != "retract":
            await self.wait_idle(ignore_waiting=self._paused == "in_place")
        await self.client.release_memory(list(wanted))
        self._released.update(wanted)
        logger.info("engine %s released %s", self.engine_id, sorted(wanted))

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back memory released under ``tags`` (None: everything released).

        Raises ValueError for a tag this engine has not released (SGLang would die).
        """
        wanted = tuple(tags) if tags is not None else tuple(sorted(self._released))
        missing = sorted(set(wanted) - self._released)
        if missing:
            raise ValueError(f"engine {self.engine_id}: tags {missing} are not released")
        if not wanted:
            return
        await self.client.resume_memory(list(wanted))
        self._released.difference_update(wanted)
        logger.info("engine %s resumed %s", self.engine_id, sorted(wanted))

    # ------------------------------------------------------------------ metrics

    async def metrics(
        self, *, component: str, worker: int, time: float, interval_s: float
    ) -> WorkerMetrics:
        """This engine's :class:`WorkerMetrics` for the interval ending now.

        ``completed`` counts requests finished through this engine since the last call.
        """
        loads = await self.client.loads()
        completed, self._completed = self._completed, 0
        return worker_metrics(
            loads,
            component=component,
            worker=worker,
            time=time,
            interval_s=interval_s,
            completed=completed,
            interruptible=True,
        )
