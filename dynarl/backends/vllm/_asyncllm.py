"""What :class:`~dynarl.backends.vllm._inprocess.VLLMInProcessEngine` needs around vLLM's
``AsyncLLM``: its arguments parsed as ``vllm serve`` parses them, construction off the
event loop (abandonable at a deadline), a stat logger that keeps the load, and a shutdown
that leaves nothing running. Imports vLLM only inside the functions that need it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dynarl.backends._engine import EngineLoad
from dynarl.backends._server_process import describe_exit

__all__ = [
    "Construction",
    "LoadTally",
    "UnknownFlags",
    "VLLMNames",
    "close_context",
    "core_exit",
    "engine_args",
    "is_client_error",
    "shutdown",
    "stat_logger_factory",
]


@dataclass(slots=True)
class LoadTally:
    """The latest scheduler reading and the counters summed since start; updated by the
    stat logger on the caller's loop (duck-typed on vLLM's ``SchedulerStats`` and
    ``IterationStats``, whose prefix-cache and preemption figures are per step)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            # vLLM's num_requests_waiting gauge counts both.
            self.waiting = (
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            )
            self.kv_usage = scheduler_stats.kv_cache_usage
            self.prefix_query_tokens += scheduler_stats.prefix_cache_stats.queries
            self.prefix_hit_tokens += scheduler_stats.prefix_cache_stats.hits
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs

    def reading(self, max_running: int, num_inflight: int) -> EngineLoad:
        """Every request in the engine is one of ``num_inflight``: the counts are capped
        there (the scheduler's report of an abort lags the aborted call's return)."""
        running = min(self.running, num_inflight)
        return EngineLoad(
            running=running,
            waiting=min(self.waiting, num_inflight - running),
            max_running=max_running,
            kv_usage=min(1.0, max(0.0, self.kv_usage)),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            preemptions=self.preemptions,
        )


def stat_logger_factory(tally: LoadTally) -> Callable[[Any, int], Any]:
    """A vLLM per-engine stat-logger factory whose loggers feed ``tally`` (imports vLLM)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _TallyLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            tally.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _TallyLogger


class Construction:
    """Builds the ``AsyncLLM`` in a worker thread and hands it over once (:meth:`take`);
    one its caller gave up on is shut down there once built, or returned by
    :meth:`abandon` if it was built already. The engine is only ever held in attributes:
    the constructing thread's frames outlive it (measured), and a local there would keep the
    engine alive past :meth:`VLLMInProcessEngine.aclose` (vLLM's finalizer would then run at
    interpreter exit, and fail there)."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._abandoned = False
        self._built: Any = None
        self._finished = threading.Event()

    def run(self) -> None:
        try:
            self._built = self._build()
            with self._lock:
                if not self._abandoned:
                    return
            self._built.shutdown()
            close_context(self._built)
            self._built = None
        finally:
            self._finished.set()

    def take(self) -> Any:
        """The engine built (once; None after that or if it was abandoned)."""
        with self._lock:
            llm, self._built = self._built, None
        return llm

    def abandon(self) -> Any:
        """Give up; the engine already built (to shut down), if any."""
        with self._lock:
            self._abandoned = True
        return self.take()

    def wait(self, timeout_s: float) -> bool:
        """Block until :meth:`run` has returned (an abandoned engine is shut down by
        then); whether it has."""
        return self._finished.wait(timeout_s)


class UnknownFlags(ValueError):
    """Flags in ``extra_args`` that vLLM's engine arguments do not take (server flags)."""


def engine_args(argv: Sequence[str]) -> Any:
    """vLLM's ``AsyncEngineArgs`` for ``argv``, parsed as ``vllm serve`` parses them
    (:class:`UnknownFlags` naming the flags it does not take)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    namespace, unknown = parser.parse_known_args(list(argv))
    if unknown:
        raise UnknownFlags(f"flags an in-process engine does not take: {unknown}")
    return AsyncEngineArgs.from_cli_args(namespace)


@dataclass(frozen=True, slots=True)
class VLLMNames:
    """What :meth:`VLLMInProcessEngine.generate` needs from vLLM, imported once by start."""

    sampling_params: Any
    final_only: Any
    tokens_input: Any


def is_client_error(exc: BaseException) -> bool:
    """Whether vLLM refused the request itself (a ``VLLMClientError``, or a ValueError its
    input checks raised: too long, bad token ids)."""
    from vllm.exceptions import VLLMClientError

    return isinstance(exc, VLLMClientError) or isinstance(
        exc.__cause__, VLLMClientError | ValueError
    )


def core_exit(llm: Any) -> str:
    """How the engine core process ended, as far as vLLM's process manager shows it."""
    resources = getattr(llm.engine_core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    codes = [p.exitcode for p in getattr(manager, "processes", ()) if p.exitcode is not None]
    return ", ".join(describe_exit(code) for code in codes) or "reported dead by vLLM"


async def shutdown(llm: Any) -> None:
    """``AsyncLLM.shutdown`` in a thread (it joins the engine core); then the loop tasks it
    cancelled from there, and the ZeroMQ context it leaves open."""
    await asyncio.to_thread(llm.shutdown)
    resources = getattr(llm.engine_core, "resources", None)
    tasks = [
        task
        for task in (llm.output_handler, getattr(resources, "output_queue_task", None))
        if task is not None
    ]
    await asyncio.sleep(0)  # the socket clean-up shutdown scheduled on this loop
    if tasks:
        await asyncio.wait(tasks, timeout=5.0)
    close_context(llm)


def close_context(llm: Any) -> None:
    """Destroy the ZeroMQ context a shut-down ``AsyncLLM`` leaves open (its I/O threads
    would run until the garbage collector found it, which then warns), and mark closed the
    asyncio context that shadows it, so that nothing terminates the freed context again
    through that one."""
    engine_core = llm.engine_core
    context = getattr(getattr(engine_core, "resources", None), "ctx", None)
    if context is None or context.closed:
        return
    context.destroy(linger=0)
    shadow = getattr(engine_core, "ctx", None)
    if shadow is not None and shadow is not context:
        shadow.closed = True
