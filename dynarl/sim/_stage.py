"""Fluid stages: log-prob inference and the trainer, as FIFO queues of token work.

A stage on ``n`` GPUs processes ``spec.rate(n)`` tokens per second of the work queued
to it, head first; a chunk (a GRPO group, or a bulk of samples) leaves when its last
token is processed and goes to ``on_done``. A stage with no GPUs holds its queue; a
paused stage (a P2P reshard in progress) makes no progress until the pause ends. The
stage accounts busy and idle device-seconds and reports like a group manager, one worker
per replica (``spec.tp`` GPUs). Driven by the simulator's event loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec
import numpy as np

from dynarl.bus import ComponentReport
from dynarl.sched import MetricsBuffer
from dynarl.sim._event_loop import EventLoop, Handle
from dynarl.sim._specs import StageSpec

__all__ = ["Chunk", "Stage"]


class Chunk:
    """Samples that travel together (a group, or a bulk from the vector model)."""

    __slots__ = ("iteration", "left", "samples", "tokens")

    def __init__(self, iteration: int, samples: int, tokens: float) -> None:
        self.iteration = iteration
        self.samples = samples
        self.tokens = tokens
        self.left = tokens


class Stage:
    """A fluid stage (see the module docstring)."""

    def __init__(
        self,
        name: str,
        kind: str,
        spec: StageSpec,
        loop: EventLoop,
        on_done: Callable[[Chunk], None],
    ) -> None:
        self.name = name
        self.spec = spec
        self.loop = loop
        self.on_done = on_done
        self.num_devices = 0
        self.paused_until = -1.0
        self.queue: deque[Chunk] = deque()
        self.queued_samples = 0
        self.t = loop.now
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.paused_s = 0.0
        self._interval_busy = 0.0
        self._interval_done = 0
        self.tokens_per_item = 1.0
        self._handle: Handle | None = None
        self._buffer = MetricsBuffer(name, kind, 0)
        self._last_report = loop.now

    @property
    def rate(self) -> float:
        """Tokens per second now (0 while paused or without GPUs)."""
        if self.loop.now < self.paused_until:
            return 0.0
        return self.spec.rate(self.num_devices)

    def advance(self, now: float) -> None:
        """Process work up to ``now`` (chunk completions are events, never skipped)."""
        if now <= self.t:
            return
        dt = now - self.t
        paused = max(0.0, min(now, self.paused_until) - self.t)
        work_dt = dt - paused
        self.paused_s += paused * self.num_devices
        rate = self.spec.rate(self.num_devices)
        busy = 0.0
        if work_dt > 0 and rate > 0 and self.queue:
            budget = rate * work_dt
            used = 0.0
            for chunk in self.queue:
                take = min(chunk.left, budget - used)
                chunk.left -= take
                used += take
                if used >= budget:
                    break
            busy = used / rate
        self.busy_s += busy * self.num_devices
        self.idle_s += (work_dt - busy) * self.num_devices
        self._interval_busy += busy
        self.t = now

    def add(self, chunk: Chunk) -> None:
        """Queue work (a fused stage passes it on at once, as an event of this instant)."""
        self.advance(self.loop.now)
        if self.spec.fused:
            self._interval_done += chunk.samples
            self.loop.at(self.loop.now, lambda: self.on_done(chunk))
            return
        self.queue.append(chunk)
        self.queued_samples += chunk.samples
        if len(self.queue) == 1:
            self._reschedule()

    def set_devices(self, num_devices: int) -> None:
        """Run on ``num_devices`` GPUs from now on."""
        self.advance(self.loop.now)
        self.num_devices = num_devices
        self._reschedule()

    def pause(self, seconds: float) -> None:
        """Make no progress for ``seconds`` from now (a reshard)."""
        self.advance(self.loop.now)
        self.paused_until = max(self.paused_until, self.loop.now + seconds)
        self._reschedule()

    def _reschedule(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        rate = self.spec.rate(self.num_devices)
        if not self.queue or rate <= 0:
            return
        start = max(self.loop.now, self.paused_until)
        self._handle = self.loop.at(start + self.queue[0].left / rate, self._on_event)

    def _on_event(self) -> None:
        self._handle = None
        self.advance(self.loop.now)
        done = []
        while self.queue and self.queue[0].left <= 1e-6 * max(self.queue[0].tokens, 1.0):
            chunk = self.queue.popleft()
            self.queued_samples -= chunk.samples
            self._interval_done += chunk.samples
            done.append(chunk)
        self._reschedule()
        for chunk in done:
            self.on_done(chunk)

    def report(self, *, remaining: int, iteration: int) -> ComponentReport:
        """One interval's report: one worker per replica, utilization = busy share."""
        now = self.loop.now
        self.advance(now)
        interval = max(now - self._last_report, 1e-9)
        self._last_report = now
        replicas = self.num_devices // self.spec.tp
        if self._buffer.num_workers != replicas:
            self._buffer.resize(replicas)
        if replicas:
            busy = min(self._interval_busy / interval, 1.0)
            queue = np.zeros(replicas, dtype=np.int64)
            queue[0] = self.queued_samples  # figures are per component; worker 0 carries them
            done = np.zeros(replicas, dtype=np.int64)
            done[0] = self._interval_done
            self._buffer.add_columns(
                np.arange(replicas),
                np.full(replicas, busy),
                queue_depth=queue,
                completed=done,
                in_flight=np.zeros(replicas, dtype=np.int64),
            )
        report = self._buffer.report(
            time=now, interval_s=interval, remaining=remaining, iteration=iteration
        )
        # Items/s as a trainer logs it: tokens per second of compute (waiting for data
        # excluded) over the profiled mean tokens of an item; 0 when it never ran.
        rate = (
            self.spec.rate(self.num_devices) / self.tokens_per_item if self._interval_busy else 0.0
        )
        report = msgspec.structs.replace(report, throughput=rate, queue_depth=self.queued_samples)
        self._interval_busy = 0.0
        self._interval_done = 0
        return report

    def new_iteration(self) -> None:
        """Zero the report's completed-in-iteration count."""
        self._buffer.new_iteration()
