"""The rollout component at scale: every engine's state in numpy arrays, advanced in lockstep.

:class:`VectorRollout` follows the same rules as :class:`~dynarl.sim._engine_model.Engine` (decode
step ``t0 + c_seq·b + c_kv·KV``, closed-form progress between events, SGLang's admission
with the decaying new-token ratio, retraction when the KV is full, prefill stalls, a
group's prompt prefilled once per engine — and never evicted, the one simplification)
for single-turn (math) workloads with FIFO queues, but holds the running requests of all
engines in one matrix (engines × slots of finish points, with each engine's next finish
cached) and processes the next event of every engine at once. Engines advance
lazily to the time of the simulator's next call; finished samples are announced then, in
order of their finish time (downstream stages see them at most one call late). Admission
and retraction run per engine in Python, only where a queue or a full KV needs them (at
scale, engines admit their whole share at dispatch and never queue). Agrees with the
per-request model within the tolerance ``bench/sim.py`` and the tests check.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from dynarl.bus import ComponentReport
from dynarl.errors import DynarlError
from dynarl.sched import FifoPolicy, MetricsBuffer, RequestPolicy
from dynarl.sim._batching import EngineArrays
from dynarl.sim._event_loop import EventLoop
from dynarl.sim._rollout import engine_groups
from dynarl.sim._trace import IterationTrace
from dynarl.sim._workload_file import Workload
from dynarl.types import ComponentKind

__all__ = ["VectorRollout"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
_EPS = 1e-7


class _View:
    """A read-only view of one engine (what the baseline policies inspect)."""

    __slots__ = ("devices", "index", "owner", "routable")

    def __init__(self, owner: VectorRollout, index: int, devices: tuple[int, ...]) -> None:
        self.owner = owner
        self.index = index
        self.devices = devices
        self.routable = True

    @property
    def batch(self) -> int:
        return int(self.owner.b[self.index])

    @property
    def load(self) -> int:
        return int(self.owner.b[self.index]) + len(self.owner.wait[self.index])


class VectorRollout(EngineArrays):
    """Rollout engines as arrays (see the module docstring); the Rollout interface."""

    name = "rollout"

    def __init__(
        self,
        workload: Workload,
        loop: EventLoop,
        policy: Callable[[], RequestPolicy],
        on_sample_done: Callable[[int, int], None],
        on_samples_done: Callable[[int, IntArray], None] | None = None,
    ) -> None:
        if workload.agentic is not None:
            raise ValueError("the vector model covers single-turn (math) workloads")
        if not isinstance(policy(), FifoPolicy):
            raise ValueError("the vector model covers FIFO engine queues only")
        rollout = workload.rollout
        prefix_options = (
            rollout.cache_block_tokens != 1
            or rollout.shared_prefix
            or rollout.prefix_cached_after_prefill
        )
        if prefix_options or rollout.request_overhead_s:
            raise ValueError("the vector model has no prefix options and no request overhead")
        super().__init__(workload, loop)
        self.on_sample_done = on_sample_done
        self.on_samples_done = on_samples_done
        self.engines: dict[int, _View] = {}
        self.traces: dict[int, IterationTrace] = {}
        self.pending: list[int] = []
        self.unfinished = 0
        self.tokens_per_item = 1.0
        self.num_resubmitted = 0
        self._buffer = MetricsBuffer(self.name, ComponentKind.ROLLOUT.value, 0)
        self._last_report = loop.now
        self._generated_seen = 0.0

    def routable(self) -> list[_View]:
        """Live engines, by index."""
        return list(self.engines.values())

    @property
    def devices(self) -> set[int]:
        """Devices held by live engines."""
        return {d for e in self.engines.values() for d in e.devices}

    def add_devices(self, devices: Iterable[int], *, routable: bool = True) -> list[_View]:
        """Start engines on ``devices``; spread queued and excess running work onto them."""
        self._sync()
        groups = engine_groups(devices, self.spec.tp, self.workload.cluster.num_gpus_per_node)
        first = self._grow(len(groups))
        new = []
        for k, group in enumerate(groups):
            view = _View(self, first + k, group)
            self.engines[view.index] = view
            new.append(view)
        if new:
            moving, self.pending = self.pending, []
            fresh = {e.index for e in new}
            old = [j for j in self.engines if j not in fresh]
            for j in old:
                moving += list(self.wait[j])
                self.wait[j].clear()
                self.queued.discard(j)
            total = int(self.b[old].sum()) + len(moving) if old else len(moving)
            share = math.ceil(total / len(self.engines))
            for j in old:
                if self.b[j] > share:
                    moving += self._shed(j, int(self.b[j]) - share)
            moving.sort()
            self._spread(moving)
        return new

    def remove_devices(self, devices: Iterable[int]) -> list[tuple[int, ...]]:
        """Abort the engines on ``devices``; re-submit their requests elsewhere."""
        self._sync()
        gone = set(devices)
        moving: list[int] = []
        leftovers = []
        for view in [e for e in self.engines.values() if gone & set(e.devices)]:
            j = view.index
            self.alive[j] = False  # nothing is admitted here any more
            moving += list(self.wait[j]) + self._shed(j, int(self.b[j]))
            self.wait[j].clear()
            self.queued.discard(j)
            self.groups[j].clear()
            del self.engines[j]
            rest = tuple(d for d in view.devices if d not in gone)
            if rest:
                leftovers.append(rest)
        self.num_resubmitted += len(moving)
        moving.sort()
        self._spread(moving)
        return leftovers

    def stop_engines(self, engines: Sequence[_View]) -> list[int]:
        """Not supported: the asynchronous policies need the per-request model."""
        raise DynarlError("verl-hybrid needs the per-request model")

    def rebalance(self) -> None:
        """Not supported (see :meth:`stop_engines`)."""
        raise DynarlError("verl-hybrid needs the per-request model")

    def start(self, trace: IterationTrace, samples: Sequence[int] | None = None) -> None:
        """Dispatch ``samples`` (all by default) group-wise to the least-loaded engines."""
        self._sync()
        if not self.traces:
            self.tokens_per_item = float(trace.output_tokens.mean())
        self.traces[trace.iteration] = trace
        index = np.arange(trace.num_samples) if samples is None else np.asarray(samples)
        self.unfinished += int(index.shape[0])
        ids = self._append(trace, index.astype(np.int64))
        if not self.engines:
            self.pending += ids.tolist()
            return
        _, first = np.unique(self.r_group[ids], return_index=True)
        order = np.argsort(first)
        starts = first[order]
        ends = np.r_[starts[1:], ids.shape[0]]
        heap = [(e.load, e.index) for e in self.engines.values()]
        heapq.heapify(heap)
        owner = np.empty(ids.shape[0], dtype=np.int64)
        for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
            load, j = heapq.heappop(heap)
            owner[lo:hi] = j
            heapq.heappush(heap, (load + hi - lo, j))
        self._dispatch(ids, owner)

    def _spread(self, requests: list[int]) -> None:
        if not requests:
            return
        if not self.engines:
            self.pending += requests
            return
        heap = [(e.load, e.index) for e in self.engines.values()]
        heapq.heapify(heap)
        owner = np.empty(len(requests), dtype=np.int64)
        for k in range(len(requests)):
            load, j = heapq.heappop(heap)
            owner[k] = j
            heapq.heappush(heap, (load + 1, j))
        self._dispatch(np.asarray(requests, dtype=np.int64), owner)

    def _sync(self) -> None:
        """Advance every engine to now; announce the samples that finished meanwhile."""
        now = self.loop.now
        spec = self.spec
        done_ids: list[IntArray] = []
        done_at: list[FloatArray] = []
        for _ in range(100_000_000):
            live = np.flatnonzero(self.alive & (self.b > 0))
            if live.size == 0:
                break
            b = self.b[live].astype(np.float64)
            g = self.g[live]
            kv = self.kv_base[live] + b * g
            cols = self.nc[live]
            to_fin = self.nf[live] - g
            to_full = np.full(live.shape[0], np.inf)
            many = b > 1
            to_full[many] = (spec.kv_capacity_tokens - b[many] - kv[many]) / b[many]
            dg = np.maximum(np.minimum(to_fin, to_full), 0.0)
            s0 = spec.step_fixed_s + spec.step_per_seq_s * b + spec.step_per_kv_token_s * kv
            start = np.maximum(self.t[live], self.stall[live])
            te = start + s0 * dg + 0.5 * spec.step_per_kv_token_s * b * dg * dg
            due = te <= now
            if not due.any():
                break
            rows = live[due]
            self.g[rows] += dg[due]
            self.gen[rows] += dg[due] * b[due]
            self.t[rows] = te[due]
            full = to_full[due] < to_fin[due]
            fin_rows, fin_cols = rows[~full], cols[due][~full]
            if fin_rows.size:
                ids = self.rid[fin_rows, fin_cols]
                self.fin[fin_rows, fin_cols] = np.inf
                self.rid[fin_rows, fin_cols] = -1
                self._refresh(fin_rows)
                self.kv_base[fin_rows] -= self.r_prompt[ids] - self.r_g0[ids]
                self.r_done[ids] = self.r_target[ids]
                self.b[fin_rows] -= 1
                self.kv_base[fin_rows[self.b[fin_rows] == 0]] = 0.0
                np.add.at(self.done_count, fin_rows, 1)
                done_ids.append(ids)
                done_at.append(te[due][~full])
            when = te[due]
            for k in np.flatnonzero(full).tolist():
                self._retract(int(rows[k]))
            for k in np.flatnonzero(full | np.isin(rows, list(self.queued))).tolist():
                self._admit(int(rows[k]), float(when[k]))
        self._advance_all(now)
        if done_ids:
            ids = np.concatenate(done_ids)
            ids = ids[np.argsort(np.concatenate(done_at), kind="stable")]
            self.unfinished -= int(ids.shape[0])
            self._announce(ids)

    def _announce(self, ids: IntArray) -> None:
        for it in np.unique(self.r_it[ids]).tolist():
            mine = ids[self.r_it[ids] == it]
            if self.on_samples_done is not None:
                self.on_samples_done(it, self.r_sample[mine])
            else:
                for sample in self.r_sample[mine].tolist():
                    self.on_sample_done(it, sample)

    def report(self, *, remaining: int, iteration: int) -> ComponentReport:
        """One interval's report (one worker per live engine, in index order)."""
        self._sync()
        now = self.loop.now
        idx = np.array(sorted(self.engines), dtype=np.int64)
        n = idx.shape[0]
        if self._buffer.num_workers != n:
            self._buffer.resize(n)
        if n:
            util = (self.kv_base[idx] + self.b[idx] * self.g[idx]) / self.spec.kv_capacity_tokens
            queue = np.zeros(self.g.shape[0], dtype=np.int64)
            for j in list(self.queued):
                if self.wait[j]:
                    queue[j] = len(self.wait[j])
                else:
                    self.queued.discard(j)
            self._buffer.add_columns(
                np.arange(n),
                np.minimum(util, 1.0),
                queue_depth=queue[idx],
                in_flight=self.b[idx],
                completed=self.done_count[idx],
            )
        self.done_count[:] = 0
        interval = max(now - self._last_report, 1e-9)
        self._last_report = now
        report = self._buffer.report(
            time=now, interval_s=interval, remaining=remaining, iteration=iteration
        )
        generated = float(self.gen.sum())
        tokens, self._generated_seen = generated - self._generated_seen, generated
        return msgspec.structs.replace(report, throughput=tokens / interval / self.tokens_per_item)

    def new_iteration(self) -> None:
        """Zero the report's completed-in-iteration count."""
        self._buffer.new_iteration()

    def busy_devices(self) -> int:
        """Devices of engines running something."""
        busy = np.flatnonzero(self.alive & (self.b > 0))
        return int(busy.shape[0]) * self.spec.tp

    def totals(self) -> tuple[int, int]:
        """(prefill tokens, of which re-prefill)."""
        return int(self.prefill_tokens), int(self.reprefill_tokens)
