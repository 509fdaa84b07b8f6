"""The rollout component at scale: every engine's state in numpy arrays, advanced in lockstep.

:class:`VectorRollout` follows the same rules as :class:`~dynarl.sim.engine.Engine` (decode
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
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from dynarl.bus import ComponentReport
from dynarl.errors import DynarlError
from dynarl.sched import FifoPolicy, MetricsBuffer, RequestPolicy
from dynarl.sim.events import EventLoop
from dynarl.sim.rollout import engine_groups
from dynarl.sim.trace import IterationTrace
from dynarl.sim.workload import Workload
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


class VectorRollout:
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
        self.workload = workload
        self.spec = workload.rollout
        self.loop = loop
        self.on_sample_done = on_sample_done
        self.engines: dict[int, _View] = {}
        self.traces: dict[int, IterationTrace] = {}
        self.pending: list[int] = []
        self.unfinished = 0
        self.tokens_per_item = 1.0
        self.num_resubmitted = 0
        n = 0
        self.g = np.zeros(n)
        self.t = np.zeros(n)
        self.stall = np.zeros(n)
        self.kv_base = np.zeros(n)
        self.b = np.zeros(n, dtype=np.int64)
        self.alive = np.zeros(n, dtype=bool)
        self.gen = np.zeros(n)
        self.ratio0 = np.zeros(n)
        self.ratio_g = np.zeros(n)
        self.done_count = np.zeros(n, dtype=np.int64)
        self.fin = np.full((n, 8), np.inf)
        self.rid = np.full((n, 8), -1, dtype=np.int64)
        self.nf = np.zeros(n)
        self.nc = np.zeros(n, dtype=np.int64)
        self.wait: list[deque[int]] = []
        self.queued: set[int] = set()
        self.groups: list[set[tuple[int, int]]] = []
        self.num_requests = 0
        self.r_sample = np.zeros(0, dtype=np.int64)
        self.r_it = np.zeros(0, dtype=np.int64)
        self.r_group = np.zeros(0, dtype=np.int64)
        self.r_prompt = np.zeros(0)
        self.r_target = np.zeros(0)
        self.r_done = np.zeros(0)
        self.r_g0 = np.zeros(0)
        self.on_samples_done = on_samples_done
        self._decay = (self.spec.new_token_ratio - self.spec.min_new_token_ratio) / max(
            self.spec.new_token_ratio_decay_steps, 1
        )
        self._buffer = MetricsBuffer(self.name, ComponentKind.ROLLOUT.value, 0)
        self._last_report = loop.now
        self._generated_seen = 0.0
        self.prefill_tokens = 0.0
        self.reprefill_tokens = 0.0

    # ---------------------------------------------------------------- engines
    def _grow(self, extra: int) -> int:
        first = self.g.shape[0]
        pad = np.zeros(extra)
        for name in ("g", "stall", "kv_base", "gen", "ratio_g", "nf"):
            setattr(self, name, np.concatenate([getattr(self, name), pad]))
        self.t = np.concatenate([self.t, np.full(extra, self.loop.now)])
        self.ratio0 = np.concatenate([self.ratio0, np.full(extra, self.spec.new_token_ratio)])
        for name in ("b", "done_count", "nc"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, np.int64)]))
        self.alive = np.concatenate([self.alive, np.ones(extra, dtype=bool)])
        cols = self.fin.shape[1]
        self.fin = np.vstack([self.fin, np.full((extra, cols), np.inf)])
        self.rid = np.vstack([self.rid, np.full((extra, cols), -1, dtype=np.int64)])
        self.nf[first:] = np.inf
        self.wait += [deque() for _ in range(extra)]
        self.groups += [set() for _ in range(extra)]
        return first

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

    # --------------------------------------------------------------- requests
    def _append(self, trace: IterationTrace, index: IntArray) -> IntArray:
        count = int(index.shape[0])
        first = self.num_requests
        need = first + count
        if need > self.r_sample.shape[0]:
            size = max(need, 2 * self.r_sample.shape[0], 1024)
            for name in ("r_sample", "r_it", "r_group", "r_prompt", "r_target", "r_done", "r_g0"):
                old = getattr(self, name)
                new = np.zeros(size, dtype=old.dtype)
                new[: old.shape[0]] = old
                setattr(self, name, new)
        sl = slice(first, need)
        self.r_sample[sl] = index
        self.r_it[sl] = trace.iteration
        self.r_group[sl] = trace.group[index]
        self.r_prompt[sl] = trace.prompt[index]
        self.r_target[sl] = trace.output[trace.turn_start[index]]
        self.r_done[sl] = 0.0
        self.r_g0[sl] = 0.0
        self.num_requests = need
        return np.arange(first, need, dtype=np.int64)

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

    def _dispatch(self, ids: IntArray, owner: IntArray) -> None:
        """Queue ``ids`` on engines ``owner`` (in order); admit, in bulk where possible."""
        order = np.argsort(owner, kind="stable")
        ids, owner = ids[order], owner[order]
        engines, first, counts = np.unique(owner, return_index=True, return_counts=True)
        empty = (self.b[engines] == 0) & np.array([not self.wait[j] for j in engines.tolist()])
        bulk = self._bulk_ok(ids, owner, engines, first, counts) & empty
        for j, lo, n, fast in zip(
            engines.tolist(), first.tolist(), counts.tolist(), bulk.tolist(), strict=True
        ):
            if not fast:
                self.wait[j].extend(ids[lo : lo + n].tolist())
                self.queued.add(j)
                self._admit(j)
        if bulk.any():
            self._admit_bulk(ids, owner, engines[bulk], first[bulk], counts[bulk])

    def _bulk_ok(
        self, ids: IntArray, owner: IntArray, engines: IntArray, first: IntArray, counts: IntArray
    ) -> npt.NDArray[np.bool_]:
        """Whether each engine, empty, would admit its whole share (SGLang's rule, all at once)."""
        spec = self.spec
        prompt, done = self.r_prompt[ids], self.r_done[ids]
        grp = self.r_group[ids] + self.r_it[ids] * (1 << 32)
        rank = np.arange(ids.shape[0]) - np.repeat(first, counts)
        fresh_group = np.r_[True, (grp[1:] != grp[:-1]) | (owner[1:] != owner[:-1])]
        need = prompt + done - np.where(fresh_group, 0.0, prompt)
        kv_before = np.cumsum(prompt + done) - (prompt + done)
        kv_before -= np.repeat(kv_before[first], counts)
        ratio = np.repeat(self._ratios(engines), counts)
        clip = spec.clip_max_new_tokens
        own = ratio * np.minimum(clip, self.workload.batch.max_seq_len - prompt - done)
        room = spec.kv_capacity_tokens - kv_before - ratio * clip * rank
        fits = (rank == 0) | (need + own <= room)
        bad = np.add.reduceat((~fits).astype(np.int64), first)
        ok: npt.NDArray[np.bool_] = (bad == 0) & (counts <= spec.max_running_requests)
        return ok

    def _admit_bulk(
        self, ids: IntArray, owner: IntArray, engines: IntArray, first: IntArray, counts: IntArray
    ) -> None:
        keep = np.isin(owner, engines)
        ids, owner = ids[keep], owner[keep]
        start = np.repeat(np.cumsum(counts) - counts, counts)
        col = np.arange(ids.shape[0]) - start
        width = int(counts.max())
        while width > self.fin.shape[1]:
            self._widen()
        g = self.g[owner]
        g0 = g - self.r_done[ids]
        self.r_g0[ids] = g0
        self.fin[owner, col] = g0 + self.r_target[ids]
        self.rid[owner, col] = ids
        prompt = self.r_prompt[ids]
        np.add.at(self.kv_base, owner, prompt - g0)
        self.b[engines] += counts
        self._refresh(engines)
        grp = self.r_group[ids] + self.r_it[ids] * (1 << 32)
        fresh_group = np.r_[True, (grp[1:] != grp[:-1]) | (owner[1:] != owner[:-1])]
        need = prompt + self.r_done[ids] - np.where(fresh_group, 0.0, prompt)
        prefill = np.bincount(owner, weights=need, minlength=self.g.shape[0])[engines]
        self.prefill_tokens += float(prefill.sum())
        self.reprefill_tokens += float((self.r_done[ids] > 0).astype(np.float64) @ need)
        now = self.loop.now
        self.stall[engines] = (
            np.maximum(now, self.stall[engines]) + prefill / self.spec.prefill_tokens_per_s
        )
        for j, key_it, key_g in zip(
            owner[fresh_group].tolist(),
            self.r_it[ids][fresh_group].tolist(),
            self.r_group[ids][fresh_group].tolist(),
            strict=True,
        ):
            self.groups[j].add((key_it, key_g))

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

    def _ratios(self, rows: IntArray) -> FloatArray:
        spec = self.spec
        ratio = self.ratio0[rows] - (self.g[rows] - self.ratio_g[rows]) * self._decay
        return np.maximum(spec.min_new_token_ratio, ratio)

    def _admit(self, j: int, at: float | None = None) -> None:
        """Admit engine ``j``'s waiting requests that fit, at time ``at`` (default: now)."""
        spec = self.spec
        q = self.wait[j]
        if not q or not self.alive[j]:
            return
        g = float(self.g[j])
        b = int(self.b[j])
        kv = float(self.kv_base[j]) + b * g
        ratio = float(self._ratios(np.array([j]))[0])
        clip, cap = spec.clip_max_new_tokens, spec.kv_capacity_tokens
        max_seq = self.workload.batch.max_seq_len
        prefill = fresh = 0.0
        while q and b < spec.max_running_requests:
            r = q[0]
            prompt, done = float(self.r_prompt[r]), float(self.r_done[r])
            key = (int(self.r_it[r]), int(self.r_group[r]))
            hit = prompt if key in self.groups[j] else 0.0
            need = prompt + done - hit
            own = ratio * min(clip, max(max_seq - prompt - done, 0.0))
            if b and need + own > cap - kv - ratio * clip * b:
                break
            q.popleft()
            self.groups[j].add(key)
            col = self._free_column(j)
            g0 = g - done
            self.r_g0[r] = g0
            self.fin[j, col] = g0 + self.r_target[r]
            self.rid[j, col] = r
            self.kv_base[j] += prompt - g0
            kv += prompt + done
            b += 1
            prefill += need
            fresh += need if done == 0 else 0.0
        self.b[j] = b
        self._refresh(j)
        if prefill:
            self.prefill_tokens += prefill
            self.reprefill_tokens += prefill - fresh
            now = self.loop.now if at is None else at
            self.stall[j] = max(now, float(self.stall[j])) + prefill / spec.prefill_tokens_per_s

    def _refresh(self, rows: IntArray | int) -> None:
        """Recompute the next finish point (and its slot) of ``rows`` after they changed."""
        rows = np.atleast_1d(np.asarray(rows, dtype=np.int64))
        if rows.size:
            cols = self.fin[rows].argmin(axis=1)
            self.nc[rows] = cols
            self.nf[rows] = self.fin[rows, cols]

    def _widen(self) -> None:
        cols = self.fin.shape[1]
        self.fin = np.hstack([self.fin, np.full((self.fin.shape[0], cols), np.inf)])
        self.rid = np.hstack([self.rid, np.full((self.rid.shape[0], cols), -1, dtype=np.int64)])

    def _free_column(self, j: int) -> int:
        free = np.flatnonzero(self.rid[j] < 0)
        if free.size:
            return int(free[0])
        cols = self.fin.shape[1]
        self._widen()
        return cols

    def _shed(self, j: int, count: int) -> list[int]:
        """Take ``count`` running requests with the least progress off engine ``j``."""
        cols = np.flatnonzero(self.rid[j] >= 0)
        if count <= 0 or cols.size == 0:
            return []
        g = float(self.g[j])
        ids = self.rid[j, cols]
        order = np.lexsort((ids, g - self.r_g0[ids]))[:count]
        cols, ids = cols[order], ids[order]
        self.r_done[ids] = np.minimum(np.floor(g - self.r_g0[ids]), self.r_target[ids] - 1)
        self.kv_base[j] -= float((self.r_prompt[ids] - self.r_g0[ids]).sum())
        self.fin[j, cols] = np.inf
        self.rid[j, cols] = -1
        self._refresh(j)
        self.b[j] -= ids.shape[0]
        if self.b[j] == 0:
            self.kv_base[j] = 0.0
        self._admit(j)
        out: list[int] = ids.tolist()
        return out

    def _retract(self, j: int) -> None:
        spec = self.spec
        cols = np.flatnonzero(self.rid[j] >= 0)
        ids = self.rid[j, cols]
        g = float(self.g[j])
        gen = g - self.r_g0[ids]
        decoded = float(gen.sum())
        max_new = float((self.workload.batch.max_seq_len - self.r_prompt[ids]).sum())
        # SGLang retracts the fewest generated tokens first, ties the longest input.
        order = np.lexsort((-self.r_prompt[ids], gen))
        kept = ids.shape[0]
        for k in order.tolist():
            b = int(self.b[j])
            if kept <= 1 or float(self.kv_base[j]) + b * g + b * spec.retract_decode_steps <= (
                spec.kv_capacity_tokens
            ):
                break
            r = int(ids[k])
            self.r_done[r] = math.floor(gen[k])
            self.kv_base[j] -= float(self.r_prompt[r] - self.r_g0[r])
            self.fin[j, cols[k]] = np.inf
            self.rid[j, cols[k]] = -1
            self.b[j] -= 1
            kept -= 1
            self.wait[j].append(r)
            self.queued.add(j)
        self._refresh(j)
        ratio = (decoded + spec.retract_decode_steps * kept) / max(max_new, 1.0)
        self.ratio0[j] = max(min(1.0, ratio), spec.min_new_token_ratio)
        self.ratio_g[j] = g

    # --------------------------------------------------------------- dynamics
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

    def _advance_all(self, now: float) -> None:
        spec = self.spec
        live = np.flatnonzero(self.alive)
        if live.size == 0:
            return
        start = np.maximum(self.t[live], self.stall[live])
        dt = np.maximum(now - start, 0.0)
        b = self.b[live].astype(np.float64)
        kv = self.kv_base[live] + b * self.g[live]
        s0 = spec.step_fixed_s + spec.step_per_seq_s * b + spec.step_per_kv_token_s * kv
        c = spec.step_per_kv_token_s * b
        dg = np.where(b > 0, 2.0 * dt / (s0 + np.sqrt(s0 * s0 + 2.0 * c * dt)), 0.0)
        self.g[live] += dg
        self.gen[live] += dg * b
        self.t[live] = np.maximum(self.t[live], now)

    # ---------------------------------------------------------------- reports
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
