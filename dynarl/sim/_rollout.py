"""The rollout component: engines on devices, a router, multi-turn episodes, reports.

Samples start as their first turn; a GRPO group goes to one engine (its siblings share
the prompt's prefix), to the least-loaded routable engine. When a turn ends and the
episode has more, the tool runs for its latency and the next turn (context + tool
output) goes back to the same engine when it is still routable (affinity ``prefer``),
else to the least-loaded one. Removing devices aborts the engines on them; their
requests, with the tokens generated so far, are re-submitted evenly to the engines that
remain (RLinf's and DynaRL's workload migration: the KV is not moved, so it is
re-prefilled). Reports are built the way a group manager builds them, with
:class:`~dynarl.sched.MetricsBuffer` (one worker per engine, utilization = active KV /
capacity). Driven by the simulator's event loop.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import msgspec
import numpy as np

from dynarl.bus import ComponentReport
from dynarl.sched import MetricsBuffer, RequestPolicy
from dynarl.sim._engine_model import Engine, SimRequest
from dynarl.sim._event_loop import EventLoop
from dynarl.sim._trace import IterationTrace
from dynarl.sim._workload_file import Workload
from dynarl.types import ComponentKind

__all__ = ["Rollout", "engine_groups"]


def engine_groups(devices: Iterable[int], tp: int, per_node: int) -> list[tuple[int, ...]]:
    """``devices`` cut into node-local groups of ``tp`` (sorted; leftovers dropped)."""
    by_node: dict[int, list[int]] = defaultdict(list)
    for d in sorted(devices):
        by_node[d // per_node].append(d)
    groups = []
    for node in sorted(by_node):
        devs = by_node[node]
        groups += [tuple(devs[i : i + tp]) for i in range(0, len(devs) - tp + 1, tp)]
    return groups


class Rollout:
    """Rollout engines and the episodes running on them (see the module docstring).

    ``on_sample_done(iteration, sample)`` is called when a sample's last turn ends.
    """

    name = "rollout"

    def __init__(
        self,
        workload: Workload,
        loop: EventLoop,
        policy: Callable[[], RequestPolicy],
        on_sample_done: Callable[[int, int], None],
        on_samples_done: object = None,
    ) -> None:
        del on_samples_done  # finished samples are announced one by one, at their time
        self.workload = workload
        self.spec = workload.rollout
        self.loop = loop
        self.policy = policy
        self.on_sample_done = on_sample_done
        self.engines: dict[int, Engine] = {}
        self._next_engine = itertools.count()
        self._rid = itertools.count()
        self.traces: dict[int, IterationTrace] = {}
        self.pending: list[SimRequest] = []
        self.unfinished = 0
        self.iteration = 0
        self.remaining = 0
        self._done_by_engine: dict[int, int] = defaultdict(int)
        self._buffer = MetricsBuffer(self.name, ComponentKind.ROLLOUT.value, 0)
        self._last_report = loop.now
        self.prefill_tokens = 0
        self.reprefill_tokens = 0
        self.num_resubmitted = 0
        self._generated = 0.0
        self._stopped_generated = 0.0
        self.tokens_per_item = 1.0

    # ---------------------------------------------------------------- engines
    @property
    def devices(self) -> set[int]:
        """Devices held by live engines."""
        return {d for e in self.engines.values() for d in e.devices}

    def routable(self) -> list[Engine]:
        """Live engines that accept new requests, by index."""
        return [e for e in self.engines.values() if e.routable]

    def add_devices(self, devices: Iterable[int], *, routable: bool = True) -> list[Engine]:
        """Start engines on ``devices`` (node-local TP groups); pending requests go to them."""
        per_node = self.workload.cluster.num_gpus_per_node
        new: list[Engine] = []
        for group in engine_groups(devices, self.spec.tp, per_node):
            engine = Engine(
                next(self._next_engine), group, self.spec, self.policy(), self.loop, self._finished
            )
            engine.routable = routable
            self.engines[engine.index] = engine
            new.append(engine)
        joining = [e for e in new if e.routable]
        if joining:
            self._rebalance_onto(joining)
        return new

    def _rebalance_onto(self, new: list[Engine]) -> None:
        """Spread queued work, and running work above the mean, over the new engines.

        Running requests moved lose their KV (re-prefilled where they land), as in a
        workload migration; only the ones beyond each engine's fair share move.
        """
        engines = self.routable()
        moving, self.pending = self.pending, []
        for engine in engines:
            if engine not in new:
                moving += engine.take_waiting()
        total = sum(e.batch for e in engines) + len(moving)
        share = math.ceil(total / len(engines))
        for engine in engines:
            if engine not in new and engine.batch > share:
                moving += engine.shed(engine.batch - share)
        moving.sort(key=lambda r: r.rid)
        self._spread(moving)

    def remove_devices(self, devices: Iterable[int]) -> list[tuple[int, ...]]:
        """Abort the engines on ``devices`` and re-submit their requests elsewhere.

        Returns the device groups left over from engines only partly removed (the
        caller decides what they become).
        """
        gone = set(devices)
        requests: list[SimRequest] = []
        leftovers = []
        for engine in [e for e in self.engines.values() if gone & set(e.devices)]:
            requests += self._stop(engine)
            rest = tuple(d for d in engine.devices if d not in gone)
            if rest:
                leftovers.append(rest)
        self.resubmit(requests)
        return leftovers

    def stop_engines(self, engines: Sequence[Engine]) -> list[SimRequest]:
        """Abort ``engines``; returns their requests (not re-submitted)."""
        out: list[SimRequest] = []
        for engine in engines:
            out += self._stop(engine)
        return out

    def rebalance(self) -> None:
        """Abort everything in flight on the routable engines and spread it again."""
        requests: list[SimRequest] = []
        for engine in self.routable():
            requests += engine.drain()
        self.resubmit(requests)

    def _stop(self, engine: Engine) -> list[SimRequest]:
        requests = engine.abort()
        self._stopped_generated += engine.generated
        self.prefill_tokens += engine.prefill_tokens
        self.reprefill_tokens += engine.reprefill_tokens
        del self.engines[engine.index]
        return requests

    # --------------------------------------------------------------- requests
    def start(self, trace: IterationTrace, samples: Sequence[int] | None = None) -> None:
        """Dispatch the first turn of ``samples`` (all of them by default), group-wise."""
        if not self.traces:
            self.tokens_per_item = float(trace.output_tokens.mean())  # the profiled mean
        self.traces[trace.iteration] = trace
        index = np.arange(trace.num_samples) if samples is None else np.asarray(samples)
        self.unfinished += int(index.shape[0])
        groups: dict[int, list[SimRequest]] = defaultdict(list)
        for s in index.tolist():
            groups[int(trace.group[s])].append(self._first_turn(trace, s))
        engines = self.routable()
        if not engines:
            for reqs in groups.values():
                self.pending += reqs
            return
        heap = [(e.load, e.index) for e in engines]
        heapq.heapify(heap)
        batches: dict[int, list[SimRequest]] = defaultdict(list)
        for reqs in groups.values():
            load, index_ = heapq.heappop(heap)
            batches[index_] += reqs
            heapq.heappush(heap, (load + len(reqs), index_))
        for index_, reqs in batches.items():
            self.engines[index_].submit_many(reqs)

    def _first_turn(self, trace: IterationTrace, s: int) -> SimRequest:
        first = int(trace.turn_start[s])
        prompt = int(trace.prompt[s])
        return SimRequest(
            rid=next(self._rid),
            sample=s,
            group=int(trace.group[s]),
            iteration=trace.iteration,
            turn=0,
            prompt=prompt,
            target=int(trace.output[first]),
            max_new=self.workload.batch.max_seq_len - prompt,
            fresh=prompt,
            cache_after=int(trace.turn_start[s + 1]) - first > 1,
        )

    def resubmit(self, requests: list[SimRequest]) -> None:
        """Spread ``requests`` evenly over the routable engines (least loaded first)."""
        self.num_resubmitted += len(requests)
        self._spread(requests)

    def _spread(self, requests: list[SimRequest]) -> None:
        if not requests:
            return
        engines = self.routable()
        if not engines:
            self.pending += requests
            return
        heap = [(e.load, e.index) for e in engines]
        heapq.heapify(heap)
        batches: dict[int, list[SimRequest]] = defaultdict(list)
        for req in requests:
            load, index = heapq.heappop(heap)
            batches[index].append(req)
            heapq.heappush(heap, (load + 1, index))
        for index, reqs in batches.items():
            self.engines[index].submit_many(reqs)

    def _route(self, req: SimRequest, prefer: Engine | None) -> None:
        if prefer is not None and prefer.alive and prefer.routable:
            prefer.submit(req)
            return
        engines = self.routable()
        if not engines:
            self.pending.append(req)
            return
        min(engines, key=lambda e: (e.load, e.index)).submit(req)

    def _finished(self, engine: Engine, req: SimRequest) -> None:
        trace = self.traces[req.iteration]
        t = int(trace.turn_start[req.sample]) + req.turn
        trip = self.spec.request_overhead_s  # the output reaches the caller this much later
        if t + 1 < int(trace.turn_start[req.sample + 1]):
            latency = float(trace.tool_latency[t]) + trip
            self.loop.after(latency, lambda: self._next_turn(engine, req, trace, t))
        elif trip:
            self.loop.after(trip, lambda: self._sample_done(engine, req))
        else:
            self._sample_done(engine, req)

    def _sample_done(self, engine: Engine, req: SimRequest) -> None:
        self.unfinished -= 1
        self._done_by_engine[engine.index] += 1
        self.on_sample_done(req.iteration, req.sample)

    def _next_turn(self, engine: Engine, req: SimRequest, trace: IterationTrace, t: int) -> None:
        obs = int(trace.observation[t])
        prompt = req.prompt + req.target + obs
        nxt = SimRequest(
            rid=next(self._rid),
            sample=req.sample,
            group=req.group,
            iteration=req.iteration,
            turn=req.turn + 1,
            prompt=prompt,
            target=int(trace.output[t + 1]),
            max_new=self.workload.batch.max_seq_len - prompt,
            fresh=obs,
            cache_after=t + 2 < int(trace.turn_start[req.sample + 1]),
            attained=req.attained + req.target,
            tool_ok=True if trace.tool_ok is None else bool(trace.tool_ok[t]),
        )
        self._route(nxt, engine)

    # ---------------------------------------------------------------- reports
    def report(self, *, remaining: int, iteration: int) -> ComponentReport:
        """One interval's report (one worker per live engine, in index order)."""
        now = self.loop.now
        engines = sorted(self.engines.values(), key=lambda e: e.index)
        if self._buffer.num_workers != len(engines):
            self._buffer.resize(len(engines))
        n = len(engines)
        if n:
            self._buffer.add_columns(
                np.arange(n),
                np.fromiter((e.utilization() for e in engines), dtype=np.float64, count=n),
                queue_depth=np.fromiter((len(e.waiting) for e in engines), np.int64, n),
                in_flight=np.fromiter((e.batch for e in engines), np.int64, n),
                completed=np.fromiter(
                    (self._done_by_engine.get(e.index, 0) for e in engines), np.float64, n
                ),
            )
        self._done_by_engine.clear()
        interval = max(now - self._last_report, 1e-9)
        self._last_report = now
        report = self._buffer.report(
            time=now, interval_s=interval, remaining=remaining, iteration=iteration
        )
        # Items/s as the manager measures it: tokens decoded over the mean tokens of a
        # finished item (per-interval completions are a noisy count, and zero while the
        # first requests of an iteration are still decoding).
        generated = sum(e.generated for e in self.engines.values()) + self._stopped_generated
        tokens, self._generated = generated - self._generated, generated
        return msgspec.structs.replace(report, throughput=tokens / interval / self.tokens_per_item)

    def new_iteration(self) -> None:
        """Zero the report's completed-in-iteration count."""
        self._buffer.new_iteration()

    def busy_devices(self) -> int:
        """Devices of engines that are running or prefilling something."""
        return sum(len(e.devices) for e in self.engines.values() if e.running)

    def totals(self) -> tuple[int, int]:
        """(prefill tokens, of which re-prefill) over all engines, live or stopped."""
        live = list(self.engines.values())
        return (
            self.prefill_tokens + sum(e.prefill_tokens for e in live),
            self.reprefill_tokens + sum(e.reprefill_tokens for e in live),
        )
