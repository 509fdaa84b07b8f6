"""Continuous batching on many engines at once: their state as numpy arrays.

:class:`EngineArrays` holds every engine's decode state (progress ``g``, time, prefill
stall, active KV, batch, SGLang's new-token ratio), the running requests as a matrix of
finish points (engines × slots, each engine's next finish cached), the FIFO queues and
the request table, and applies the rules of :mod:`dynarl.sim._engine_model` to them: admission
(in bulk where an empty engine takes its whole share at once), retraction, shedding,
advancing in closed form. :class:`~dynarl.sim._vector.VectorRollout` builds the rollout
component on it. Single-threaded.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import numpy.typing as npt

from dynarl.sim._event_loop import EventLoop
from dynarl.sim._trace import IterationTrace
from dynarl.sim._workload_file import Workload

__all__ = ["EngineArrays"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class EngineArrays:
    """The state of every engine and request, and the per-engine rules on it."""

    def __init__(self, workload: Workload, loop: EventLoop) -> None:
        self.workload = workload
        self.spec = workload.rollout
        self.loop = loop
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
        self._decay = (self.spec.new_token_ratio - self.spec.min_new_token_ratio) / max(
            self.spec.new_token_ratio_decay_steps, 1
        )
        self.prefill_tokens = 0.0
        self.reprefill_tokens = 0.0

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
        # SGLang retracts the fewest generated tokens first, ties the longest input, then (as
        # the per-request model) the newest request.
        order = np.lexsort((-ids, -self.r_prompt[ids], gen))
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
