"""The simulated SGLang scheduler behind the fake server: queues, KV pool, prefix cache.

It reproduces the behaviour SGLang 0.5.23's scheduler and tokenizer manager show at the
HTTP boundary (sources in the pinned wheel, ``srt/managers``):

- one iteration admits waiting requests (priority order, then arrival) while
  ``max_running_requests`` and the KV pool allow, each producing its first token, and gives
  every other running request one token;
- admission matches the prompt but its last token against the radix cache
  (``meta_info.cached_tokens``) and locks it; a finished request caches prompt + output
  (its last token has no KV yet);
- aborting a *waiting* request finishes it at once (``"Abort in waiting queue"``, meta
  without ``prompt_tokens``/``cached_tokens``); aborting a *running* one sets ``to_finish``
  and it ends at the next iteration with one more token and ``"Aborted"``;
- pause ``abort`` blocks new requests and aborts everything; ``retract`` and ``in_place``
  also stop iterations (retract moves running requests back to waiting, freeing their KV);
- with ``return_logprob`` each output token's log-probability comes back as
  ``meta_info.output_token_logprobs`` (``[logprob, token_id, null]``), and with
  ``logprob_start_len = k >= 0`` the prompt's from token ``k`` on as
  ``input_token_logprobs`` (the first entry's log-prob null, as SGLang's is; the prefix
  cache is matched no further than ``k``); a final reply
  carries ``meta_info.weight_versions``, the spans of output tokens per weight version
  (:mod:`._versions`), as SGLang's output streamer and tokenizer manager compute them;
- "idle" for flush and memory release is SGLang's ``is_fully_idle``: nothing running, and
  nothing waiting unless the engine is paused.

Not modelled: chunked prefill, batching limits on prefill tokens, grammar, LoRA, DP ranks,
``n > 1`` and batch requests. Runs on the fake server's event loop only.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynarl.testing.sglang_fake._cache import PrefixCache, PrefixNode
from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._versions import (
    VersionEvent,
    next_token,
    token_logprob,
    version_spans,
)

__all__ = ["FakeScheduler", "Req", "SchedulerCrashed"]

_ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
_ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class SchedulerCrashed(RuntimeError):
    """The simulated scheduler hit an assertion that kills a real SGLang server."""


@dataclass(eq=False, slots=True)
class Req:
    """One generate request inside the fake (SGLang's ``Req`` + tokenizer ``ReqState``)."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    min_new_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    priority: int | None
    stream: bool
    arrival: float
    seq: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    """Where prompt log-probs start (-1: none are returned)."""
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_events: list[VersionEvent] = field(default_factory=list)
    cached_tokens: int = 0
    cached_len: int = 0
    node: PrefixNode | None = None
    to_finish: dict[str, Any] | None = None
    finish_reason: dict[str, Any] | None = None
    num_retractions: int = 0
    chunks: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)

    @property
    def seqlen(self) -> int:
        return len(self.prompt) + len(self.output)


def _prompt_logprobs(prompt: list[int], start: int) -> list[list[Any]]:
    """``meta_info.input_token_logprobs`` from prompt token ``start`` on (none for -1)."""
    if not 0 <= start < len(prompt):
        return []
    scored = [
        [token_logprob(prompt[:index], prompt[index]), prompt[index], None]
        for index in range(start + 1, len(prompt))
    ]
    return [[None, prompt[start], None], *scored]


def _text(token_ids: list[int]) -> str:
    return "".join(chr(token) for token in token_ids)


class FakeScheduler:
    """Request queues, a KV pool with a radix cache, and one iteration per :meth:`step`."""

    def __init__(self, config: FakeSGLangConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.cache = PrefixCache()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.in_flight: dict[str, Req] = {}
        self.frontend_paused = False
        self.engine_paused = False
        self.updating = False
        self.offloaded: set[str] = set()
        self.weight_version = config.weight_version
        self.crashed: str | None = None
        self.changed = asyncio.Condition()
        self._seq = itertools.count()
        self.cache_hit_rate = 0.0
        self.total_prefill_uncached = 0
        self.recent_tokens: deque[tuple[float, int]] = deque(maxlen=64)

    # ------------------------------------------------------------------ state

    @property
    def private_tokens(self) -> int:
        """KV tokens held by running requests outside the cache (their outputs)."""
        return sum(req.seqlen - req.cached_len for req in self.running)

    @property
    def num_used_tokens(self) -> int:
        """SGLang's ``num_used``: capacity minus free and evictable tokens."""
        return self.cache.locked + self.private_tokens

    def idle(self) -> bool:
        """SGLang's ``is_fully_idle(ignore_waiting=engine_paused)``."""
        return not self.running and (self.engine_paused or not self.waiting)

    def _urgency(self, req: Req) -> tuple[int, int]:
        """Sort key: smaller is admitted first."""
        if not self.config.enable_priority_scheduling:
            return (0, req.seq)
        low_first = self.config.schedule_low_priority_values_first
        priority = req.priority
        if priority is None:
            priority = sys.maxsize if low_first else -sys.maxsize - 1
        return (priority if low_first else -priority, req.seq)

    async def notify(self) -> None:
        """Wake everyone waiting on :attr:`changed`."""
        async with self.changed:
            self.changed.notify_all()

    # ------------------------------------------------------------------ requests

    def new_req(self, *, rid: str, prompt: list[int], sampling: dict[str, Any], **kw: Any) -> Req:
        """Build a request (the tokenizer manager's side of admission)."""
        stop = sampling.get("stop_token_ids") or ()
        return Req(
            rid=rid,
            prompt=prompt,
            max_new_tokens=int(sampling.get("max_new_tokens", 128)),
            min_new_tokens=int(sampling.get("min_new_tokens") or 0),
            stop_token_ids=frozenset(int(token) for token in stop),
            ignore_eos=bool(sampling.get("ignore_eos") or False),
            arrival=self.clock(),
            seq=next(self._seq),
            **kw,
        )

    def register(self, req: Req) -> None:
        """Track a new request (tokenizer ``_init_req_state``); ValueError on a duplicate rid."""
        self._raise_if_crashed()
        if req.rid in self.in_flight:
            raise ValueError(f"Duplicate request ID detected: {req.rid}")
        self.in_flight[req.rid] = req

    def unregister(self, req: Req) -> None:
        """Forget a request that never reached the queue (validation failed, client left)."""
        if self.in_flight.get(req.rid) is req:
            del self.in_flight[req.rid]

    async def wait_dispatchable(self) -> None:
        """Wait while generation is paused or a weight update holds the writer lock."""
        async with self.changed:
            await self.changed.wait_for(
                lambda: bool(self.crashed) or not (self.frontend_paused or self.updating)
            )
        self._raise_if_crashed()

    async def wait_drained(self) -> None:
        """Wait until nothing is queued or running (the writer lock's wait for readers)."""
        async with self.changed:
            await self.changed.wait_for(
                lambda: bool(self.crashed) or not (self.running or self.waiting)
            )
        self._raise_if_crashed()

    async def enqueue(self, req: Req) -> None:
        """Hand a validated request to the scheduler's waiting queue."""
        if (
            not self.config.enable_priority_scheduling
            and req.priority is not None
            and self.config.abort_on_priority_when_disabled
        ):
            message = (
                "Using priority is disabled for this server. "
                "Please send a new request without a priority."
            )
            self._finish(req, {"type": "abort", "status_code": 503, "message": message}, False)
            return
        self.waiting.append(req)
        await self.notify()

    def abort(self, rid: str, abort_all: bool) -> None:
        """``/abort_request``: an unknown exact rid is a no-op; a known one aborts every
        in-flight rid it prefixes (SGLang's scheduler matches with ``startswith``)."""
        if not abort_all and rid not in self.in_flight:
            return
        for req in [r for r in self.waiting if abort_all or r.rid.startswith(rid)]:
            self.waiting.remove(req)
            self._finish(req, dict(_ABORT_WAITING), in_waiting=True)
        for req in self.running:
            if req.finish_reason is None and (abort_all or req.rid.startswith(rid)):
                req.to_finish = dict(_ABORT_RUNNING)

    async def pause(self, mode: str) -> None:
        """``/pause_generation``; ``abort`` returns once every aborted request has ended."""
        self.frontend_paused = True
        if mode == "abort":
            self.abort("", abort_all=True)
            await self.notify()
            await self.wait_drained()
            return
        self.engine_paused = True
        if mode == "retract":
            for req in list(self.running):
                self._retract(req)
        await self.notify()

    async def resume(self) -> None:
        """``/continue_generation``."""
        self.frontend_paused = False
        self.engine_paused = False
        await self.notify()

    def set_weight_version(self, version: str | None) -> None:
        """``record_weight_version_change``: later tokens report ``version``; every live
        request with output remembers where the old version ended."""
        if version is None or version == self.weight_version:
            return
        for req in {*self.running, *self.waiting}:
            if req.output:
                req.version_events.append(VersionEvent(self.weight_version, len(req.output)))
        self.weight_version = version

    # ------------------------------------------------------------------ one iteration

    async def step(self) -> None:
        """One scheduler iteration; wakes everyone waiting on :attr:`changed`."""
        if self.crashed:
            return
        if not self.engine_paused:
            admitted = self._admit()
            generated = 0
            for req in list(self.running):
                if req not in admitted:
                    generated += self._decode(req)
            generated += len(admitted)
            self.recent_tokens.append((self.clock(), generated))
        await self.notify()

    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        if self.offloaded & {"weights", "kv_cache"}:
            return admitted
        hit = total = 0
        for req in sorted(self.waiting, key=self._urgency):
            if not (self._try_admit(req) or self._preempt_for(req)):
                break
            hit += req.cached_tokens
            total += req.seqlen
            admitted.append(req)
            self._emit_token(req)
        if total:
            self.cache_hit_rate = hit / total
            self.total_prefill_uncached += total - hit
        return admitted

    def _try_admit(self, req: Req) -> bool:
        """Admit ``req`` if a running slot and its KV (prompt + remaining budget) fit."""
        if len(self.running) >= self.config.max_running_requests:
            return False
        sequence = req.prompt + req.output
        use_cache = not self.config.disable_radix_cache
        # The last token is always computed (its logits sample the next one), as in SGLang.
        matchable = len(sequence) - 1
        if req.return_logprob and req.logprob_start_len >= 0:
            matchable = min(matchable, req.logprob_start_len)  # its logits are needed
        root = (0, self.cache.root)
        matched, node = self.cache.match(sequence[:matchable]) if use_cache else root
        self.cache.lock(node)  # keep the matched prefix through the eviction below
        reserved = sum(r.max_new_tokens - len(r.output) for r in self.running)
        need = len(sequence) - matched + req.max_new_tokens - len(req.output) + reserved
        short = need - self._free_tokens()
        if short > 0:
            self.cache.evict(short)
        self.cache.unlock(node)
        if need > self._free_tokens():
            return False
        if use_cache:
            req.node = self.cache.insert(sequence)
            self.cache.lock(req.node)
        req.cached_len = len(sequence) if use_cache else 0
        req.cached_tokens = matched
        self.waiting.remove(req)
        self.running.append(req)
        return True

    def _free_tokens(self) -> int:
        return self.config.max_total_num_tokens - self.cache.size - self.private_tokens

    def _preempt_for(self, req: Req) -> bool:
        """Priority preemption: retract less urgent running requests past the threshold."""
        if not self.config.enable_priority_scheduling or self.config.disable_priority_preemption:
            return False
        threshold = self.config.priority_scheduling_preemption_threshold
        while not self._try_admit(req):
            victims = [r for r in self.running if r.to_finish is None]
            if not victims:
                return False
            victim = max(victims, key=self._urgency)
            if self._urgency(victim)[0] - self._urgency(req)[0] < threshold:
                return False
            self._retract(victim)
        return True

    def _retract(self, req: Req) -> None:
        self._release(req, cache_output=False)
        req.num_retractions += 1
        self.running.remove(req)
        self.waiting.append(req)

    def _decode(self, req: Req) -> int:
        if req.to_finish is not None:
            self._sample(req)
            self._release(req, cache_output=False)
            self.running.remove(req)
            self._finish(req, req.to_finish, in_waiting=False)
            return 1
        self._emit_token(req)
        return 1

    def _emit_token(self, req: Req) -> None:
        token = self._sample(req)
        reason: dict[str, Any] | None = None
        if token in req.stop_token_ids and len(req.output) >= req.min_new_tokens:
            reason = {"type": "stop", "matched": token}
        elif len(req.output) >= req.max_new_tokens:
            reason = {"type": "length", "length": req.max_new_tokens}
        if reason is None:
            if req.stream:
                req.chunks.put_nowait(self._out(req, None))
            return
        self._release(req, cache_output=True)
        self.running.remove(req)
        self._finish(req, reason, in_waiting=False)

    @staticmethod
    def _sample(req: Req) -> int:
        """Append the next token (:func:`._versions.next_token`) and its log-probability."""
        token, logprob = next_token(req.prompt + req.output)
        req.output.append(token)
        req.logprobs.append(logprob)
        return token

    def _release(self, req: Req, *, cache_output: bool) -> None:
        if cache_output and not self.config.disable_radix_cache:
            self.cache.insert(req.prompt + req.output[:-1])
        if req.node is not None:
            self.cache.unlock(req.node)
            req.node = None
        req.cached_len = 0

    # ------------------------------------------------------------------ outputs

    def _meta(self, req: Req, reason: dict[str, Any] | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.prompt),
            "weight_version": self.weight_version,
            "num_retractions": req.num_retractions,
            "reasoning_tokens": 0,
            "completion_tokens": len(req.output),
            "cached_tokens": req.cached_tokens,
        }
        if reason is not None:
            self._add_versions(meta, req)
        self._add_logprobs(meta, req)
        return meta

    def _add_versions(self, meta: dict[str, Any], req: Req) -> None:
        spans = version_spans(req.version_events, self.weight_version, len(req.output))
        meta["weight_versions"] = spans
        meta["weight_version"] = spans[-1]["version"]

    @staticmethod
    def _add_logprobs(meta: dict[str, Any], req: Req) -> None:
        if req.return_logprob:
            meta["input_token_logprobs"] = _prompt_logprobs(req.prompt, req.logprob_start_len)
            meta["output_token_logprobs"] = [
                [logprob, token, None]
                for logprob, token in zip(req.logprobs, req.output, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(req.output)

    def _out(self, req: Req, reason: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "text": _text(req.output),
            "output_ids": list(req.output),
            "meta_info": self._meta(req, reason),
        }

    def _finish(self, req: Req, reason: dict[str, Any], in_waiting: bool) -> None:
        req.finish_reason = reason
        latency = self.clock() - req.arrival
        if in_waiting:
            meta: dict[str, Any] = {
                "id": req.rid,
                "finish_reason": reason,
                "weight_version": self.weight_version,
                "e2e_latency": latency,
            }
            self._add_versions(meta, req)
            self._add_logprobs(meta, req)
            meta["completion_tokens"] = len(req.output)
            out: dict[str, Any] = {
                "text": _text(req.output),
                "output_ids": list(req.output),
                "meta_info": meta,
            }
        else:
            out = self._out(req, reason)
            out["meta_info"]["e2e_latency"] = latency
        self.in_flight.pop(req.rid, None)
        req.chunks.put_nowait(out)

    # ------------------------------------------------------------------ control

    def flush(self) -> bool:
        """Reset the radix cache if idle (``Scheduler.flush_cache``)."""
        if not self.idle():
            return False
        self.cache.reset()
        return True

    def release_memory(self, tags: list[str] | None) -> None:
        """``release_memory_occupation``; not idle kills a real server (assertion)."""
        if not self.idle():
            self.crash("release_memory_occupation should be called only when server is idle.")
        for tag in tags or MEMORY_TAGS:
            self.offloaded.add(tag)
        if "kv_cache" in (tags or MEMORY_TAGS):
            self.cache.reset()

    def resume_memory(self, tags: list[str] | None) -> list[str]:
        """``resume_memory_occupation``; resuming a tag not released kills a real server
        (``set.remove`` raises). Returns the tags resumed."""
        resumed = list(tags or MEMORY_TAGS)
        for tag in resumed:
            if tag not in self.offloaded:
                self.crash(f"KeyError: {tag!r}")
            self.offloaded.remove(tag)
        return resumed

    def crash(self, message: str) -> None:
        """Die like a real scheduler: every in-flight request fails, the server stays down."""
        self.crashed = message
        for req in list(self.in_flight.values()):
            req.chunks.put_nowait({"crash": message})
        self.in_flight.clear()
        self.waiting.clear()
        self.running.clear()
        raise SchedulerCrashed(message)

    def _raise_if_crashed(self) -> None:
        if self.crashed:
            raise SchedulerCrashed(self.crashed)
