"""One simulated rollout engine: continuous batching, a KV budget, a prefix cache.

The engine follows SGLang's scheduler closely enough for time-to-finish to come out
right. Every decode step generates one token for each running request and takes
``step_time(batch, active KV tokens)``; between events the batch is fixed and the KV
grows by one token per request per step, so the engine's progress counter ``g`` (decode
steps since it started) solves ``dt = s0·dg + (c·b/2)·dg²`` in closed form (``c``: step
time per KV token). A request finishes when ``g`` reaches its admission point plus its
target tokens (a heap keyed by that point), so the work per event is O(log n) whatever
the batch.

Admission (SGLang's PrefillAdder): waiting requests, in the order of the engine's
:class:`~dynarl.sched.RequestQueue` (FIFO or DynaRL's priority), are admitted while the
batch is below ``max_running_requests`` and the KV left after reserving
``new_token_ratio × clip_max_new_tokens`` per running request holds the request's
uncached tokens and its own reserve; the first that does not fit stops admission.
Admitted prompts are prefilled before decoding resumes (decode stalls). When the KV is
full, requests are retracted (fewest generated tokens first, ties the longest input)
until ``retract_decode_steps`` steps of headroom are free, and the reserve ratio is
raised; it decays back to its floor over ``new_token_ratio_decay_steps`` steps.

Prefix cache: a finished turn leaves its context cached (agentic), a group's prompt is
cached once prefilled (GRPO siblings share it); cached tokens share the KV budget and
are evicted least recently used when running requests need the room; a prefix is reused
in whole blocks of ``cache_block_tokens``. With ``shared_prefix`` (what SGLang's radix
tree and vLLM's block pool do; off in the validated model) siblings running on a cached
group prompt hold its KV once and it stays while they run, and eviction frees a prefix
from its tail, so what is left still serves its head. With
``prefix_cached_after_prefill`` (SGLang, measured) a group prompt enters the cache when the
prefill batch that computed it ends, so its siblings admitted in that same batch each
compute it; otherwise (vLLM) it is cached as its first request is admitted. An eviction
re-keys the waiting request that would have reused the prefix, so priority ordering
sees what is really cached. :meth:`Engine.abort` returns every request with its partial
output (the caller re-submits it elsewhere: the KV is not moved). Single-threaded,
driven by the simulator's event loop.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from dynarl.sched import QueuedRequest, RequestPolicy, RequestQueue
from dynarl.sim._event_loop import EventLoop, Handle
from dynarl.sim._specs import RolloutSpec

__all__ = ["Engine", "SimRequest"]

_EPS = 1e-7


@dataclass(slots=True, eq=False)
class SimRequest:
    """One turn of one sample, as it moves between queues and engines."""

    rid: int
    """Unique id within the run."""
    sample: int
    """Sample (episode) index within its iteration."""
    group: int
    """Group (prompt) index within its iteration."""
    iteration: int
    """Iteration (batch) the sample belongs to."""
    turn: int
    """Tool calls its episode completed before this turn (k_r)."""
    prompt: int
    """Context tokens before this turn's output."""
    target: int
    """Output tokens this turn generates."""
    max_new: int
    """Output tokens the request may generate at most (what the engine plans with)."""
    fresh: int
    """Tokens of the context never prefilled before (prompt on turn 0, else observation)."""
    cache_after: bool = False
    """Keep the context cached when the turn ends (another turn of the episode follows)."""
    done: int = 0
    """Output tokens of this turn generated before its current admission (partials)."""
    attained: float = 0.0
    """Tokens its episode generated in earlier turns (least-attained-service)."""
    g0: float = 0.0
    """Engine progress at admission minus ``done``: it finishes at ``g0 + target``."""
    epoch: int = 0
    """Admission count (stale heap entries are recognised by it)."""
    tool_ok: bool = True
    """Whether the tool call before this turn succeeded (True on turn 0)."""
    shared: int = 0
    """While it runs: tokens of its prompt held once, in its group's cached prompt, for
    every sibling that runs on it (the engines share a cached prefix's KV)."""

    @property
    def cache_key(self) -> tuple[int, int, int]:
        """The prefix it can reuse: its episode's context, or (turn 0) its group's prompt."""
        return (
            (1, self.iteration, self.sample) if self.turn > 0 else (0, self.iteration, self.group)
        )


class Engine:
    """A rollout engine (see the module docstring); ``on_finish`` is called per finished turn."""

    def __init__(
        self,
        index: int,
        devices: tuple[int, ...],
        spec: RolloutSpec,
        policy: RequestPolicy,
        loop: EventLoop,
        on_finish: Callable[[Engine, SimRequest], None],
    ) -> None:
        self.index = index
        self.devices = devices
        self.spec = spec
        self.loop = loop
        self.on_finish = on_finish
        self.alive = True
        self.routable = True
        self.g = 0.0
        self.t = loop.now
        self.stall_until = loop.now
        self.running: dict[int, SimRequest] = {}
        self._heap: list[tuple[float, int, int]] = []
        self.kv_base = 0.0
        self.queue = RequestQueue(policy)
        self.waiting: dict[str, SimRequest] = {}
        self._waiting_by_key: dict[tuple[int, int, int], str] = {}
        self.cache: OrderedDict[tuple[int, int, int], int] = OrderedDict()
        self.cached_tokens = 0
        self._pins: dict[tuple[int, int, int], int] = {}
        self.pinned_tokens = 0
        self.shared_kv = 0
        self._ratio_start = spec.new_token_ratio
        self._ratio_g = 0.0
        self._decay = (spec.new_token_ratio - spec.min_new_token_ratio) / max(
            spec.new_token_ratio_decay_steps, 1
        )
        self._handle: Handle | None = None
        self.completed = 0
        self.generated = 0.0
        self.prefill_tokens = 0
        self.reprefill_tokens = 0
        self.num_retractions = 0
        self.admitted_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------------ state
    @property
    def batch(self) -> int:
        """Requests running now."""
        return len(self.running)

    @property
    def load(self) -> int:
        """Requests running or waiting."""
        return len(self.running) + len(self.waiting)

    @property
    def kv_tokens(self) -> float:
        """Active KV tokens of the running requests, a shared prompt counted once (at the
        last advance)."""
        return self.kv_base + len(self.running) * self.g + self.pinned_tokens

    def utilization(self) -> float:
        """Active KV tokens / capacity (DynaRL's rollout signal), advanced to now."""
        self.advance(self.loop.now)
        return min(self.kv_tokens / self.spec.kv_capacity_tokens, 1.0)

    def ratio(self) -> float:
        """SGLang's current new-token ratio."""
        return max(
            self.spec.min_new_token_ratio,
            self._ratio_start - (self.g - self._ratio_g) * self._decay,
        )

    # --------------------------------------------------------------- dynamics
    def advance(self, now: float) -> None:
        """Decode up to ``now`` (no event can fall inside; the caller ensures it)."""
        if now <= self.t:
            return
        start = self.t if self.t > self.stall_until else self.stall_until
        b = len(self.running)
        if now > start and b:
            dt = now - start
            spec = self.spec
            s0 = spec.step_time(b, self.kv_base + self.shared_kv + b * self.g)
            c = spec.step_per_kv_token_s * b
            dg = 2.0 * dt / (s0 + math.sqrt(s0 * s0 + 2.0 * c * dt))
            self.g += dg
            self.generated += dg * b
        self.t = now

    def _reschedule(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        b = len(self.running)
        if not self.alive or not b:
            return
        spec = self.spec
        kv = self.kv_base + b * self.g  # memory (a shared prompt is in the cache)
        to_finish = self._heap[0][0] - self.g
        if self.cached_tokens:  # running KV grows into cached prefixes: evict them then
            to_full = (spec.kv_capacity_tokens - b - kv - self.cached_tokens) / b
        else:
            to_full = (spec.kv_capacity_tokens - b - kv) / b if b > 1 else math.inf
        dg = max(min(to_finish, to_full), 0.0)
        s0 = spec.step_time(b, kv + self.shared_kv)  # attention reads every context whole
        dt = s0 * dg + 0.5 * spec.step_per_kv_token_s * b * dg * dg
        start = self.t if self.t > self.stall_until else self.stall_until
        self._handle = self.loop.at(start + dt, self._on_event)

    def _on_event(self) -> None:
        self._handle = None
        now = self.loop.now
        self.advance(now)
        finished = self._pop_finished()
        b = len(self.running)
        cap = self.spec.kv_capacity_tokens
        if b and self.kv_base + b * self.g + self.cached_tokens >= cap - b - 1e-6:
            self._evict(headroom=b * self.spec.retract_decode_steps)
        if b > 1 and self.kv_base + b * self.g + self.pinned_tokens >= cap - b - 1e-6:
            self._retract()
        self._step(now)
        for req in finished:
            self.on_finish(self, req)

    def _pop_finished(self) -> list[SimRequest]:
        finished = []
        heap, running = self._heap, self.running
        limit = self.g + _EPS
        while heap and heap[0][0] <= limit:
            _, rid, epoch = heapq.heappop(heap)
            req = running.get(rid)
            if req is None or req.epoch != epoch:
                continue
            del running[rid]
            self._release(req)
            req.done = req.target
            finished.append(req)
            self.completed += 1
            if req.cache_after:
                self._cache_put((1, req.iteration, req.sample), req.prompt + req.target)
        if not running:
            self._idle()
        return finished

    def _release(self, req: SimRequest) -> None:
        """Take a request that stops running out of the KV accounting."""
        self.kv_base -= req.prompt - req.shared - req.g0
        if req.shared:
            self.shared_kv -= req.shared
            key = req.cache_key
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]
                self.pinned_tokens -= self.cache.get(key, 0)
            req.shared = 0

    def _idle(self) -> None:
        """No request runs: clear the running sums (no float drift carries over)."""
        self.kv_base = 0.0
        self.shared_kv = 0
        if self._pins:  # pragma: no cover - every release unpins
            raise AssertionError(f"prefixes pinned with nothing running: {self._pins}")
        self.pinned_tokens = 0

    def _retract(self) -> None:
        spec = self.spec
        # Popped from the end: the fewest generated tokens, then the longest input, then the
        # newest request (the vector model breaks ties the same way).
        order = sorted(
            self.running.values(), key=lambda r: (self.g - r.g0, -r.prompt, -r.rid), reverse=True
        )
        decoded = sum(self.g - r.g0 for r in order)
        max_new = sum(r.max_new for r in order)
        while len(order) > 1:
            b = len(self.running)
            held = self.kv_base + b * self.g + self.pinned_tokens
            if held + b * spec.retract_decode_steps <= spec.kv_capacity_tokens:
                break
            req = order.pop()
            del self.running[req.rid]
            req.done = int(self.g - req.g0)
            self._release(req)
            self.num_retractions += 1
            self._enqueue(req)
        self._ratio_start = min(
            1.0, (decoded + spec.retract_decode_steps * len(order)) / max(max_new, 1)
        )
        self._ratio_start = max(self._ratio_start, spec.min_new_token_ratio)
        self._ratio_g = self.g

    # -------------------------------------------------------------- admission
    def submit(self, req: SimRequest) -> None:
        """Queue ``req`` here (admitting at once if it fits)."""
        self.submit_many([req])

    def submit_many(self, requests: list[SimRequest]) -> None:
        """Queue several requests, then admit."""
        self.advance(self.loop.now)
        for req in requests:
            self._enqueue(req)
        self._step(self.loop.now)

    def _hit(self, req: SimRequest) -> int:
        """Tokens of ``req``'s prompt the cache serves: its cached prefix, in whole blocks."""
        hit = min(self.cache.get(req.cache_key, 0), req.prompt)
        return hit - hit % self.spec.cache_block_tokens

    def _enqueue(self, req: SimRequest) -> None:
        key = str(req.rid)
        self.queue.push(
            QueuedRequest(
                request_id=key,
                tool_calls=req.turn,
                cached_prefix=self._hit(req),
                attained_service=req.attained + req.done,
                tool_ok=req.tool_ok,
            )
        )
        self.waiting[key] = req
        if req.turn:
            self._waiting_by_key[req.cache_key] = key

    def _step(self, now: float) -> None:
        if self.alive:
            self._admit(now)
            self._evict()
        self._reschedule()

    def _admit(self, now: float) -> None:
        spec = self.spec
        queue, waiting, running = self.queue, self.waiting, self.running
        ratio = self.ratio()
        clip = spec.clip_max_new_tokens
        prefill = 0
        batch_prompts: set[tuple[int, int, int]] = set()
        """Group prompts first cached by this prefill batch."""
        while waiting and len(running) < spec.max_running_requests:
            head = queue.peek()
            assert head is not None
            req = waiting[head.request_id]
            in_batch = spec.prefix_cached_after_prefill and req.cache_key in batch_prompts
            hit = 0 if in_batch else self._hit(req)
            need = req.prompt + req.done - hit
            b = len(running)
            held = self.kv_base + b * self.g + self.pinned_tokens
            room = spec.kv_capacity_tokens - held - ratio * clip * b
            own = ratio * min(clip, max(req.max_new - req.done, 0))
            if b and need + own > room:
                break
            queue.pop()
            del waiting[head.request_id]
            if req.turn and self._waiting_by_key.get(req.cache_key) == head.request_id:
                del self._waiting_by_key[req.cache_key]
            if req.turn == 0 and req.cache_key not in self.cache:
                batch_prompts.add(req.cache_key)
            self._take_cache(req, hit)
            req.epoch += 1
            req.g0 = self.g - req.done
            running[req.rid] = req
            if not in_batch:  # a sibling in the same batch computes its own copy
                self._share(req)
            self.kv_base += req.prompt - req.shared - req.g0
            heapq.heappush(self._heap, (req.g0 + req.target, req.rid, req.epoch))
            prefill += need
            self.admitted_tokens += req.prompt + req.done
            self.hit_tokens += hit
            self.reprefill_tokens += max(0, need - req.fresh)
            req.fresh = 0
        if prefill:
            self.prefill_tokens += prefill
            start = now if now > self.stall_until else self.stall_until
            self.stall_until = start + prefill / spec.prefill_tokens_per_s

    # ------------------------------------------------------------------ cache
    def _take_cache(self, req: SimRequest, hit: int) -> None:
        key = req.cache_key
        if key not in self.cache:
            if req.turn == 0:
                self._cache_put(key, req.prompt)
            return
        if key[0] == 1:  # an episode's context becomes running KV
            self.cached_tokens -= self.cache.pop(key)
        else:
            self.cache.move_to_end(key)

    def _share(self, req: SimRequest) -> None:
        """A first turn runs on its group's cached prompt: pin it (not evictable while a
        sibling runs on it) and count its tokens once."""
        key = req.cache_key
        if not self.spec.shared_prefix or key[0] != 0:
            return
        shared = min(self.cache.get(key, 0), req.prompt)
        if not shared:
            return
        req.shared = shared
        self.shared_kv += shared
        count = self._pins.get(key, 0)
        if not count:
            self.pinned_tokens += self.cache[key]
        self._pins[key] = count + 1

    def _cache_put(self, key: tuple[int, int, int], tokens: int) -> None:
        old = self.cache.pop(key, None)
        if old is not None:
            self.cached_tokens -= old
        self.cache[key] = tokens
        self.cached_tokens += tokens

    def _evict(self, headroom: float = 0.0) -> None:
        """Evict least recently used prefixes until running KV, cache and ``headroom`` fit:
        whole (the validated model), or with ``shared_prefix`` from their tails, whole
        blocks at a time, skipping those in use (a radix tree frees leaves first; vLLM frees
        a sequence's blocks from its last), so the head of a prefix outlives its tail."""
        cap = self.spec.kv_capacity_tokens - headroom
        used = self.kv_base + len(self.running) * self.g
        block = self.spec.cache_block_tokens
        while used + self.cached_tokens > cap:
            key = next((k for k in self.cache if k not in self._pins), None)
            if key is None:
                break  # what is cached is in use
            tokens = self.cache[key]
            excess = used + self.cached_tokens - cap
            cut = tokens
            if self.spec.shared_prefix:  # at least a block: float noise must not stall it
                cut = min(tokens, block * max(1, math.ceil(excess / block - _EPS)))
            self.cached_tokens -= cut
            if cut == tokens:
                del self.cache[key]
            else:
                self.cache[key] = tokens - cut
            waiting = self._waiting_by_key.get(key)
            if waiting is not None and waiting in self.waiting:
                left = self._hit(self.waiting[waiting]) if key in self.cache else 0
                self.queue.update(waiting, cached_prefix=left)

    # ------------------------------------------------------------------ abort
    def drain(self) -> list[SimRequest]:
        """Abort every running and waiting request (with its partial output); keep running.

        The prefix cache is kept, as SGLang keeps its radix tree on abort.
        """
        self.advance(self.loop.now)
        out = []
        for req in self.running.values():
            req.done = min(int(self.g - req.g0), req.target - 1) if req.target > 1 else 0
            self._release(req)
            out.append(req)
        out += self.take_waiting()
        self.running.clear()
        self._heap.clear()
        self._idle()
        self._reschedule()
        return out

    def abort(self) -> list[SimRequest]:
        """Stop the engine for good; every request, with its partial output."""
        out = self.drain()
        self.cache.clear()
        self.cached_tokens = 0
        self.alive = False
        self._reschedule()
        return out

    def shed(self, count: int) -> list[SimRequest]:
        """Abort the ``count`` running requests with the least progress (to move them)."""
        self.advance(self.loop.now)
        order = sorted(self.running.values(), key=lambda r: (self.g - r.g0, r.rid))
        out = []
        for req in order[: max(count, 0)]:
            del self.running[req.rid]
            req.done = int(self.g - req.g0)
            self._release(req)
            out.append(req)
        if not self.running:
            self._idle()
        self._step(self.loop.now)
        return out

    def take_waiting(self) -> list[SimRequest]:
        """Remove and return the requests waiting (not running) here, in arrival order."""
        out = [self.waiting[q.request_id] for q in self.queue]
        self.waiting.clear()
        self._waiting_by_key.clear()
        self.queue = RequestQueue(self.queue.policy)
        return out
