"""The serving components of a reference job: rollout, inference and tools as runtime roles.

* :class:`ReferenceRollout` (``rollout``): a
  :class:`~dynarl.backends.reference.RolloutEngine` per device. Its ``run()`` loop steps
  the engine on the worker's compute thread while there is work; ``serve`` queues one
  request (a continuation after an abort resumes at the right absolute positions) and
  answers with the bus ``Sample`` — the new tokens, their log-probabilities and weight
  versions; ``abort`` returns every request's partial output at once. The engine's
  waiting room is the scheduler's priority queue
  (:class:`PriorityRequestQueue`: ``dynarl.sched.RequestQueue`` with the
  ``PriorityPolicy`` by default), and it reports KV utilization (active KV tokens /
  capacity). Weights: the initial file at start, the colocated trainer's copy (the
  worker's shared slot) on waking, or a transfer planned by the migrate planner
  (``receive_weights``).
* :class:`ReferenceInference` (``inference``): a
  :class:`~dynarl.backends.reference.LogProbWorker` scoring whole sequences under the
  frozen initial (reference) weights.
* :class:`ReferenceTools` (``tools``): the calculator behind its latency distribution.

Every role runs on its worker's event loop; compute goes to the worker's one compute
thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import msgspec

from dynarl.backends.reference._gpt import local_world
from dynarl.backends.reference._logprob import LogProbWorker
from dynarl.backends.reference._request import FinishReason, GenerationOutput, PendingRequest
from dynarl.backends.reference._request import GenerationRequest as EngineRequest
from dynarl.backends.reference._rollout_engine import RolloutEngine
from dynarl.backends.reference._samples import SEED_ID, TOOL_CALLS, pack_floats
from dynarl.backends.reference._setup import ReferenceSetup
from dynarl.backends.reference._tokenizer import CharTokenizer
from dynarl.backends.reference._tools import ToolWorker
from dynarl.backends.reference._weights import WEIGHTS_SLOT, run_sync, sync_plan
from dynarl.bus import GenerationRequest, MetaValue, Sample, WorkerGroup, pack_tokens, unpack_tokens
from dynarl.migrate import build_group
from dynarl.runtime import FINISH, PROMPT_LEN, VERSIONS, encode_versions
from dynarl.runtime.worker import RoleContext, RoleMetrics
from dynarl.sched import PriorityPolicy, QueuedRequest, RequestPolicy, RequestQueue
from dynarl.types import ComponentKind

__all__ = [
    "PriorityRequestQueue",
    "ReferenceInference",
    "ReferenceRollout",
    "ReferenceTools",
]

logger = logging.getLogger(__name__)


class PriorityRequestQueue:
    """The engine's waiting room over ``dynarl.sched``'s :class:`~dynarl.sched.RequestQueue`
    (the reference engine's ``RequestQueue`` protocol: ``push/pop/remove/len``).

    Keys: completed tool calls and cached prefix (``PriorityPolicy``, Algorithm 2), the
    tokens the episode has generated (least-attained-service), aging by overtakes.
    """

    def __init__(self, policy: RequestPolicy | None = None, *, max_overtakes: int = 64) -> None:
        self._queue = RequestQueue(policy or PriorityPolicy(), max_overtakes=max_overtakes)
        self._items: dict[int, PendingRequest] = {}

    def push(self, item: PendingRequest) -> None:
        """Queue ``item``; ValueError if its sample is already queued."""
        if item.sample_id in self._items:
            raise ValueError(f"sample {item.sample_id} is already queued")
        request = item.request
        self._queue.push(
            QueuedRequest(
                request_id=str(item.sample_id),
                tool_calls=request.num_tool_calls,
                cached_prefix=item.cached_prefix_tokens,
                attained_service=float(len(request.resumed_tokens)),
            )
        )
        self._items[item.sample_id] = item

    def pop(self) -> PendingRequest:
        """The next request by the policy; IndexError when empty."""
        return self._items.pop(int(self._queue.pop().request_id))

    def remove(self, sample_id: int) -> PendingRequest | None:
        """Take ``sample_id`` out if it waits here."""
        item = self._items.pop(sample_id, None)
        if item is not None:
            self._queue.remove(str(sample_id))
        return item

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Load:
    """A snapshot of the engine's load, taken on the compute thread."""

    utilization: float = 0.0
    running: int = 0
    queued: int = 0


class ReferenceRollout(WorkerGroup, kind=ComponentKind.ROLLOUT, name="rollout"):
    """A rollout engine as a serving role (see the module docstring); options: a
    :class:`~dynarl.backends.reference.ReferenceSetup`."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.setup = ReferenceSetup.from_options(ctx.options)
        self.tokenizer = CharTokenizer()
        self.engine: RolloutEngine | None = None
        self._waiting: dict[int, asyncio.Future[GenerationOutput]] = {}
        self._wakeup = asyncio.Event()
        self._load = _Load()
        self._lock = threading.Lock()
        self._completed = 0

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Build the engine with the initial weights (version 0), or newer shared ones."""
        await self.ctx.compute(self._build)

    def _build(self) -> None:
        engine = RolloutEngine(self.setup.model, self.setup.engine, queue=PriorityRequestQueue())
        engine.load_weights(self.setup.initial_weights(), 0)
        self.engine = engine
        self._load_shared()

    async def wake(self) -> None:
        """Take the weights a colocated trainer left while this role slept."""
        await self.ctx.compute(self._load_shared)

    def _load_shared(self) -> None:
        held = self.ctx.shared.get(WEIGHTS_SLOT)
        if self.engine is None or held is None:
            return
        version, state = held
        if version > self.engine.weight_version:
            self.engine.load_weights(state, version)

    async def run(self) -> None:
        """Step the engine while it has work; wait for work otherwise."""
        while True:
            engine = self.engine
            if engine is None or not engine.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            for output in await self.ctx.compute(self._step, engine):
                self._resolve(output)

    def _step(self, engine: RolloutEngine) -> list[GenerationOutput]:
        outputs = engine.step()
        self._snapshot(engine)
        return outputs

    def _snapshot(self, engine: RolloutEngine) -> None:
        stats = engine.stats()
        load = _Load(
            utilization=stats.utilization, running=stats.num_running, queued=stats.num_queued
        )
        with self._lock:
            self._load = load

    def _resolve(self, output: GenerationOutput) -> None:
        future = self._waiting.pop(output.sample_id, None)
        if future is not None and not future.done():
            future.set_result(output)
        if output.finish_reason is not FinishReason.ABORT:
            with self._lock:
                self._completed += 1

    # ------------------------------------------------------------------ serving

    async def serve(self, item: GenerationRequest | Sample) -> Sample:
        """Generate ``item`` (a bus ``GenerationRequest``; a continuation carries the
        original prompt length in ``prompt_len`` metadata). Raises TypeError for a
        ``Sample``, ValueError for a request the engine cannot take."""
        if not isinstance(item, GenerationRequest):
            raise TypeError(f"the rollout serves GenerationRequests, not {type(item).__name__}")
        engine = self.engine
        assert engine is not None, "serve before start"
        context = [int(t) for t in unpack_tokens(item.token_ids)]
        request = self._engine_request(item, context)
        future: asyncio.Future[GenerationOutput] = asyncio.get_running_loop().create_future()
        self._waiting[request.sample_id] = future
        try:
            await self.ctx.compute(self._submit, engine, request)
        except BaseException:
            self._waiting.pop(request.sample_id, None)
            raise
        self._wakeup.set()
        output = await future
        return self._sample(item, context, output)

    def _submit(self, engine: RolloutEngine, request: EngineRequest) -> None:
        engine.submit(request)
        self._snapshot(engine)

    def _engine_request(self, item: GenerationRequest, context: list[int]) -> EngineRequest:
        meta = item.metadata
        prompt_len = meta.get(PROMPT_LEN, len(context))
        cut = int(prompt_len) if isinstance(prompt_len, int) else len(context)
        resumed = tuple(context[cut:])
        seed_id = meta.get(SEED_ID)
        calls = meta.get(TOOL_CALLS, 0)
        return EngineRequest(
            sample_id=int(seed_id) if isinstance(seed_id, int) else int(item.sample_id),
            prompt=tuple(context[:cut]),
            max_new_tokens=item.max_new_tokens + len(resumed),
            seed=item.seed if item.seed is not None else self.setup.seed,
            temperature=item.temperature,
            stop_tokens=self.setup.stop_tokens(self.tokenizer),
            num_tool_calls=int(calls) if isinstance(calls, int) else 0,
            resumed_tokens=resumed,
            resumed_logprobs=(0.0,) * len(resumed),
            resumed_versions=(-1,) * len(resumed),
        )

    def _sample(self, item: GenerationRequest, context: list[int], out: GenerationOutput) -> Sample:
        skip = len(out.request.resumed_tokens)
        new = list(out.tokens[skip:])
        meta: dict[str, MetaValue] = {
            **item.metadata,
            FINISH: str(out.finish_reason),
            VERSIONS: encode_versions(out.versions[skip:]),
            "device": self.ctx.device,
        }
        return Sample(
            sample_id=item.sample_id,
            token_ids=pack_tokens(context + new),
            prompt_len=len(context),
            prompt_id=item.prompt_id,
            logprobs=pack_floats(out.logprobs[skip:]),
            policy_version=self.engine.weight_version if self.engine is not None else -1,
            metadata=meta,
        )

    async def abort(self) -> None:
        """Make every pending ``serve`` return its partial output now."""
        engine = self.engine
        if engine is None:
            return
        for output in await self.ctx.compute(self._abort_all, engine):
            self._resolve(output)

    def _abort_all(self, engine: RolloutEngine) -> list[GenerationOutput]:
        outputs = engine.abort_all()
        self._snapshot(engine)
        return outputs

    def metrics(self) -> RoleMetrics:
        """KV utilization, running and queued requests, generations finished."""
        with self._lock:
            load, done, self._completed = self._load, self._completed, 0
        return RoleMetrics(
            utilization=min(1.0, load.utilization),
            queue_depth=load.queued,
            in_flight=load.running,
            completed=done,
        )

    # ------------------------------------------------------------------ calls

    def receive_weights(
        self, samples: Sequence[Sample], *, trainer: str, rollout: str, tag: str, version: int
    ) -> dict[str, MetaValue]:
        """Receive the trainer's parameters (the receiving side of the trainer's
        ``sync_weights``, same ``trainer``, ``rollout`` and ``tag``) and load them."""
        src = [int(d) for d in trainer.split(",") if d]
        dst = [int(d) for d in rollout.split(",") if d]
        plan = sync_plan(self.setup.model, src, dst)
        result = run_sync(
            plan,
            model=self.setup.model,
            rank=self.ctx.device,
            store=self.ctx.store,
            tag=tag,
            sources=None,
        )
        assert self.engine is not None
        if result.state:
            self.engine.load_weights(result.state, version)
        received = result.report.bytes_received if result.report is not None else 0
        return {"version": self.engine.weight_version, "bytes_received": received}

    def weight_version(self, samples: Sequence[Sample]) -> dict[str, MetaValue]:
        """The engine's weight version (-1 before start)."""
        return {"version": self.engine.weight_version if self.engine is not None else -1}


class ReferenceInference(WorkerGroup, kind=ComponentKind.INFERENCE, name="inference"):
    """Scores sequences under the frozen initial weights (the reference policy): a
    ``Sample`` in, the same sample out with ``logprobs`` replaced by the per-target
    log-probs of all its tokens (``len(tokens) - 1`` of them)."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.setup = ReferenceSetup.from_options(ctx.options)
        self.worker: LogProbWorker | None = None

    async def start(self) -> None:
        """Build the scorer with the reference weights."""
        await self.ctx.compute(self._build)

    def _build(self) -> None:
        local_world()
        group = build_group(
            self.ctx.store,
            name=f"dynarl/inference/{self.ctx.epoch}/{self.ctx.device}",
            ranks=(self.ctx.device,),
            rank=self.ctx.device,
            timeout=timedelta(seconds=30),
        )
        worker = LogProbWorker(
            self.setup.model, tp_group=group.pg, temperature=self.setup.temperature
        )
        worker.load_weights(self.setup.initial_weights(), 0)
        self.worker = worker

    async def serve(self, item: GenerationRequest | Sample) -> Sample:
        """The reference log-probs of ``item``'s tokens. TypeError for a request."""
        if not isinstance(item, Sample):
            raise TypeError(f"inference serves Samples, not {type(item).__name__}")
        worker = self.worker
        assert worker is not None, "serve before start"
        tokens = [int(t) for t in unpack_tokens(item.token_ids)]
        (logprobs,) = await self.ctx.compute(worker.compute, [tokens])
        meta = {**item.metadata, "scored": "reference", FINISH: "stop"}
        return msgspec.structs.replace(item, logprobs=pack_floats(logprobs), metadata=meta)

    async def abort(self) -> None:
        """Nothing to cut short: each score is one forward pass."""


class ReferenceTools(WorkerGroup, kind=ComponentKind.TOOL, name="tools"):
    """The calculator as a service: a ``Sample`` whose ``expression`` metadata is the call,
    answered with ``output`` metadata after the drawn latency (a wait, not compute)."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.setup = ReferenceSetup.from_options(ctx.options)
        self.tool = ToolWorker(latency=self.setup.tool_latency, seed=self.setup.seed)

    async def serve(self, item: GenerationRequest | Sample) -> Sample:
        """Evaluate the call in ``item.metadata["expression"]``; TypeError for a request."""
        if not isinstance(item, Sample):
            raise TypeError(f"tools serve Samples, not {type(item).__name__}")
        expression = str(item.metadata.get("expression", ""))
        call_id = int(item.metadata.get("call_id", 0) or 0)
        result = await self.tool.call(expression, call_id=call_id)
        meta = {**item.metadata, "output": result.output, FINISH: "stop"}
        return Sample(
            sample_id=item.sample_id,
            token_ids=item.token_ids,
            prompt_len=item.prompt_len,
            prompt_id=item.prompt_id,
            metadata=meta,
        )

    async def abort(self) -> None:
        """Tool calls are short waits: they finish; nothing is cut."""
