"""Real inference engines (vLLM, SGLang) as runtime roles: ``EngineRollout`` generates,
``EngineInference`` scores.

One engine per device (:class:`~dynarl.backends.serving.EngineSetup`): the worker launches
its server on ``start()`` and stops it on ``close()`` (or attaches to a running one). The
runtime drives it as it drives the reference engine:

- ``serve(GenerationRequest)`` sends the request's token ids to the engine with dynarl's
  priority and sampling parameters (its seed mixed with the sample id:
  :func:`request_seed`) and answers with the bus ``Sample``: prompt and new
  tokens, each new token's log-probability and weight version (:data:`VERSIONS`), the
  engine's cached-prefix count (``cached_tokens``) and the device. A continuation — the
  runtime re-dispatching an aborted request with its partial output appended, the original
  prompt length in :data:`PROMPT_LEN` — is just a longer prompt with what remains of the
  budget: there is one re-dispatch path, the runtime's;
- ``abort()`` aborts every request this role has in flight; each pending ``serve`` returns
  its partial output (``finish`` = ``"abort"``), which the runtime continues elsewhere;
- ``sleep()``/``wake()`` pause the engine (``keep``) and resume it; ``metrics()`` reports
  the engine's load as read every ``metrics_interval_s``: utilization is the larger of KV
  use and running requests over the engine's limit (:class:`EngineLoad`);
- ``set_weight_version(version=N)`` (a call) labels the weights in force, so later tokens
  report ``N`` (a launched engine starts at 0; a role attaching to a running server adopts
  the version its label holds); ``engine_address()`` (a call) says where a trainer pushes
  weights to each device's engine (kind, name, server URL).

An engine that dies under the role (killed, crashed: a server this role launched exits)
raises :class:`~dynarl.errors.EngineLostError` from ``serve`` and ``run``; the worker then
leaves the job, which treats the device as lost: its requests continue on the other
engines and the device is reclaimed. A server the role attached to is not its to watch;
its failures stay BackendErrors on the requests.

``EngineInference`` shares all of that (life cycle, load, loss, version label) and serves
``Sample``s instead: each comes back with ``logprobs`` replaced by the engine's log-prob of
every token after the first (:meth:`Engine.score`), as the reference inference role
answers; a score is one prefill, so ``abort()`` lets it finish.

Runs on the worker's event loop; no compute thread is needed (the engine is another
process).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import msgspec

from dynarl.backends._engine import (
    Engine,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    ScoreRequest,
)
from dynarl.backends._server_engine import ServerEngine
from dynarl.backends.serving._setup import EngineSetup
from dynarl.bus import (
    GenerationRequest,
    MetaValue,
    Sample,
    WorkerGroup,
    pack_floats,
    pack_tokens,
    unpack_tokens,
)
from dynarl.errors import BackendError, EngineLostError
from dynarl.runtime import FINISH, VERSIONS, encode_versions
from dynarl.runtime.worker import RoleContext, RoleMetrics
from dynarl.types import ComponentKind

__all__ = ["CACHED_TOKENS", "EngineInference", "EngineRollout", "request_seed"]

logger = logging.getLogger(__name__)

CACHED_TOKENS = "cached_tokens"
"""Sample metadata key: prompt tokens the engine served from its prefix cache."""
_ABORT_ROUND_S = 0.05
"""Pause between abort rounds: an abort reaches only requests the server has received."""
_ABORT_DEADLINE_S = 30.0
_EXIT_POLLS, _EXIT_POLL_S = 20, 0.05
"""After a failed request: how long to look for the engine's exit status (1 s)."""
T = TypeVar("T")


class _EngineRole(WorkerGroup, abstract=True):
    """What both engine roles share: one engine per device, its life cycle, its load, its
    loss, its weight-version label (see the module docstring)."""

    role = "engine"
    """The role's name in messages."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.setup = EngineSetup.from_options(ctx.options)
        self.engine: Engine | None = None
        self.version = 0
        """The weight version in force (the label the engine reports)."""
        self._inflight: dict[str, asyncio.Task[Any]] = {}
        self._ids = itertools.count()
        self._load: EngineLoad | None = None
        self._completed = 0
        self._cached = 0
        self._prompted = 0
        self._asleep = False

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Start this device's engine (BackendError naming it, with its log tail, if it
        cannot) and label its weights with version 0 — or, attached to a running server
        whose label is a version (a trainer pushed to it while no role drove it, e.g. while
        this device trained), adopt that version. An attached server is resumed first: the
        device is this role's now, and a role that held it before (another component
        attached to the same server, e.g. a scorer and a rollout sharing each device's
        engine) paused it when it gave the device up and sleeps until it gets it back."""
        engine = self.setup.build(self.ctx.device, cpus=self.ctx.cpus)
        try:
            await engine.start()
            if self.setup.urls:
                await engine.resume()
            label = await engine.weight_version() if self.setup.urls else ""
            if _version(label) >= 0:
                self.version = _version(label)
            else:
                await engine.set_weight_version(str(self.version))
        except BaseException:
            await engine.aclose()
            raise
        self.engine = engine
        self._load = await engine.load()

    async def close(self) -> None:
        """Stop the engine; a server it attached to keeps running, resumed if this role
        had paused it (left as it was found)."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        try:
            if self._asleep:
                await engine.resume()
        finally:
            await engine.aclose()

    async def sleep(self) -> None:
        """Freeze the engine in place (it holds its memory, uses no compute)."""
        if self.engine is not None:
            await self.engine.pause("keep")
            self._asleep = True

    async def wake(self) -> None:
        """Resume after :meth:`sleep`."""
        if self.engine is not None:
            await self.engine.resume()
            self._asleep = False

    async def run(self) -> None:
        """Read the engine's load every ``metrics_interval_s`` (a failed read is logged and
        the last one kept); EngineLostError once the engine has died."""
        while True:
            await asyncio.sleep(self.setup.metrics_interval_s)
            engine = self.engine
            if engine is None:
                continue
            self._raise_if_lost(engine, None)
            try:
                self._load = await engine.load()
            except BackendError as exc:
                self._raise_if_lost(engine, exc)
                logger.warning(
                    "%s on device %d: load read failed: %s", self.role, self.ctx.device, exc
                )

    def _started(self) -> Engine:
        """The engine; BackendError before :meth:`start`."""
        if self.engine is None:
            raise BackendError(f"{self.role} on device {self.ctx.device}: not started")
        return self.engine

    async def _tracked(self, request_id: str, call: Awaitable[T]) -> T:
        """Await ``call`` as the in-flight request ``request_id``: a cancelled caller aborts
        it; a failure of an engine that has died raises EngineLostError."""
        engine = self._started()
        task = asyncio.ensure_future(call)
        self._inflight[request_id] = task
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await self._abort([request_id])
            raise
        except BackendError as exc:
            await self._raise_if_exited(engine, exc)
            raise
        finally:
            self._inflight.pop(request_id, None)

    async def _raise_if_exited(self, engine: Engine, exc: BackendError) -> None:
        """EngineLostError if the failed request's engine process has ended, once it has
        been reaped (a killed server's connections drop a moment before its exit status
        is known: bounded wait); returns if it still runs."""
        for _ in range(_EXIT_POLLS):
            self._raise_if_lost(engine, exc)
            await asyncio.sleep(_EXIT_POLL_S)
        self._raise_if_lost(engine, exc)

    def _raise_if_lost(self, engine: Engine, exc: BackendError | None) -> None:
        cause = engine.exit_cause
        if cause is not None:
            raise EngineLostError(
                f"{self.role} on device {self.ctx.device}: engine {engine.name} {cause}"
            ) from exc

    async def _abort(self, request_ids: Sequence[str]) -> None:
        engine = self.engine
        if engine is None:
            return
        waiting = {rid: self._inflight[rid] for rid in request_ids if rid in self._inflight}
        async with asyncio.timeout(_ABORT_DEADLINE_S):
            while waiting:
                await asyncio.gather(*(engine.abort(rid) for rid in waiting))
                await asyncio.wait(waiting.values(), timeout=_ABORT_ROUND_S)
                waiting = {rid: task for rid, task in waiting.items() if not task.done()}

    def metrics(self) -> RoleMetrics:
        """The engine's load as last read, and requests finished since the last call."""
        load = self._load
        done, self._completed = self._completed, 0
        hit = self._cached / self._prompted if self._prompted else 0.0
        if load is None:
            return RoleMetrics(utilization=0.0, completed=done)
        return RoleMetrics(
            utilization=load.utilization,
            queue_depth=load.waiting,
            in_flight=max(load.running, len(self._inflight) - load.waiting),
            completed=done,
            cache_hit_rate=min(1.0, hit),
        )

    # ------------------------------------------------------------------ calls

    async def set_weight_version(
        self, samples: Sequence[Sample], *, version: int
    ) -> dict[str, MetaValue]:
        """Label the weights in force ``version``: tokens sampled from now on report it."""
        await self._started().set_weight_version(str(version))
        self.version = version
        return {"version": version}

    def weight_version(self, samples: Sequence[Sample]) -> dict[str, MetaValue]:
        """The weight version in force (-1 before start)."""
        return {"version": self.version if self.engine is not None else -1}

    def engine_address(self, samples: Sequence[Sample]) -> dict[str, MetaValue]:
        """Where a trainer pushes weights to this device's engine: its kind (``vllm``,
        ``sglang``), its name and its server's root URL (empty for an in-process engine,
        which has none). BackendError before start."""
        engine = self._started()
        url = engine.url if isinstance(engine, ServerEngine) else None
        return {"kind": self.setup.kind, "name": engine.name, "url": url or ""}


class EngineRollout(_EngineRole, kind=ComponentKind.ROLLOUT, name="rollout"):
    """A real engine per device as the rollout role (see the module docstring); options:
    an :class:`EngineSetup` (``EngineSetup(...).to_options()``)."""

    role = "rollout"

    # ------------------------------------------------------------------ serving

    async def serve(self, item: GenerationRequest | Sample) -> Sample:
        """Generate ``item`` (see the module docstring). TypeError for a ``Sample``;
        BackendError if the engine fails the request."""
        if not isinstance(item, GenerationRequest):
            raise TypeError(f"the rollout serves GenerationRequests, not {type(item).__name__}")
        engine = self._started()
        context = tuple(int(t) for t in unpack_tokens(item.token_ids))
        request = EngineRequest(
            request_id=f"{item.sample_id}#{self.ctx.device}.{next(self._ids)}",
            token_ids=context,
            max_new_tokens=item.max_new_tokens,
            temperature=item.temperature,
            top_p=item.top_p,
            seed=None if item.seed is None else request_seed(item.seed, item.sample_id),
            stop_token_ids=self.setup.stop_token_ids,
            ignore_eos=self.setup.ignore_eos,
            priority=item.priority,
        )
        output = await self._tracked(request.request_id, engine.generate(request))
        if not output.aborted:
            self._completed += 1
        self._prompted += output.prompt_tokens
        self._cached += output.cached_tokens
        return self._sample(item, context, output)

    def _sample(
        self, item: GenerationRequest, context: tuple[int, ...], out: EngineOutput
    ) -> Sample:
        versions = [_version(label) for label in out.token_versions()]
        meta: dict[str, MetaValue] = {
            **item.metadata,
            FINISH: out.finish,
            VERSIONS: encode_versions(versions),
            CACHED_TOKENS: out.cached_tokens,
            "device": self.ctx.device,
        }
        return Sample(
            sample_id=item.sample_id,
            token_ids=pack_tokens(context + out.token_ids),
            prompt_len=len(context),
            prompt_id=item.prompt_id,
            logprobs=pack_floats(out.logprobs),
            policy_version=versions[-1] if versions else self.version,
            metadata=meta,
        )

    async def abort(self) -> None:
        """Make every pending ``serve`` return its partial output now."""
        await self._abort(list(self._inflight))


class EngineInference(_EngineRole, kind=ComponentKind.INFERENCE, name="inference"):
    """A real engine per device as an inference component: scores sequences under the
    weights it holds (a reference policy, or the old policy's log-probs recomputed). A
    ``Sample`` in, the same sample out with ``logprobs`` replaced by the log-prob of each
    of its tokens after the first (``len(tokens) - 1`` of them), as
    :class:`~dynarl.backends.reference.ReferenceInference` answers; options: an
    :class:`EngineSetup`."""

    role = "inference"

    async def serve(self, item: GenerationRequest | Sample) -> Sample:
        """Score ``item``'s tokens. TypeError for a request, ValueError for a sample of
        fewer than two tokens; BackendError if the engine fails it."""
        if not isinstance(item, Sample):
            raise TypeError(f"inference serves Samples, not {type(item).__name__}")
        engine = self._started()
        tokens = tuple(int(t) for t in unpack_tokens(item.token_ids))
        request = ScoreRequest(
            request_id=f"{item.sample_id}#{self.ctx.device}.{next(self._ids)}",
            token_ids=tokens,
        )
        logprobs = await self._tracked(request.request_id, engine.score(request))
        self._completed += 1
        meta: dict[str, MetaValue] = {
            **item.metadata,
            "scored": engine.name,
            FINISH: "stop",
            "device": self.ctx.device,
        }
        return msgspec.structs.replace(item, logprobs=pack_floats(logprobs), metadata=meta)

    async def abort(self) -> None:
        """Nothing to cut short: each score is one prefill, and it finishes."""


def request_seed(seed: int, sample_id: str) -> int:
    """The engine's sampling seed for sample ``sample_id`` of a job seeded ``seed``: the bus
    keys randomness by seed *and* sample id, while an engine seeds each request's generator
    with one number — so a prompt group's episodes, which share the job's seed, must not
    share it (they would sample the same tokens). Stable across processes (BLAKE2b, 63
    bits: a collision among a step's thousands of episodes is as good as impossible, where
    CRC-32's 32 bits gave one among 4096 ids for some seeds)."""
    digest = hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _version(label: str) -> int:
    """dynarl's integer version of an engine's label (-1 for one dynarl did not set)."""
    return int(label) if label.lstrip("-").isdigit() else -1
