"""verl fully-async training with hybrid replicas (dynamic resource scheduling), in virtual time.

Standalone rollout engines (the static split's rollout GPUs) always generate; the
trainer's GPUs (the split's inference and trainer GPUs: verl computes log-probs on the
trainer) host hybrid replicas that generate only while the trainer waits. The real
:class:`~dynarl.sched.HybridController` with the real ``default`` policy (built by
:func:`~dynarl.sched.build_policy`, verl's unclamped ratio unless the workload asks for
the clamp) decides; this module only carries out its operations in the model
(:class:`_Replicas`) and runs verl's trainer loop as a :class:`~dynarl.sim._event_loop.Task`:
per sync cycle, before training the controller may wait for buffered samples and
deactivate the hybrid replicas; the trainer then takes ``trigger_parameter_sync_step``
collections of ``required_samples`` from the message queue (waiting when it is short),
syncs weights, and the controller may activate the replicas again. The rollouter feeds
GRPO groups continuously, at most ``(1 + staleness_threshold)`` cycles' worth per weight
version (partial rollouts continue across versions). One cycle is one iteration.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from dynarl.bus import ComponentReport
from dynarl.sched import DeviceMove, DynamicScheduleContext, HybridController, build_policy
from dynarl.sim._components import SimEvent
from dynarl.sim._event_loop import Task, Wait
from dynarl.sim._profile import best_partition
from dynarl.sim._rollout import Rollout
from dynarl.sim._simulator import Simulation
from dynarl.sim._stage import Chunk, Stage
from dynarl.sim._trace import IterationTrace, build_trace
from dynarl.types import ComponentKind

__all__ = ["VerlHybrid"]


class VerlHybrid:
    """verl-hybrid (see the module docstring)."""

    name = "verl-hybrid"
    asynchronous = True

    def __init__(self, partition: Mapping[str, int] | None = None) -> None:
        self.partition = dict(partition) if partition is not None else None
        self.mq: deque[Chunk] = deque()
        self.mq_samples = 0
        self.generated = 0
        self.staleness = 0
        self.in_flight = 0
        self._waiters: list[tuple[int, Wait]] = []
        self._traces: dict[int, IterationTrace] = {}
        self._group_tokens: dict[int, list[float]] = {}
        self.only_hybrid = False
        self._group_left: dict[tuple[int, int], int] = {}
        self._cursor = (0, 0)
        self._train_done: Wait | None = None
        self.hybrid: tuple[int, ...] = ()
        self.controller: HybridController | None = None

    def setup(self, sim: Simulation) -> None:
        """Place standalone and trainer GPUs; start the rollouter and the trainer loop."""
        w = sim.workload
        if not isinstance(sim.rollout, Rollout):
            raise ValueError("verl-hybrid needs the per-request rollout model")
        part = self.partition or best_partition(w)
        a = part["inference"] + part["trainer"]
        inf, tr = w.inference.tokens_per_s_per_gpu, w.trainer.tokens_per_s_per_gpu
        spec = replace(w.trainer, tokens_per_s_per_gpu=1.0 / (1.0 / inf + 1.0 / tr))
        sim.trainer = Stage("trainer", ComponentKind.TRAINER.value, spec, sim.loop, self._trained)
        sim.assign({"rollout": part["rollout"], "trainer": a})
        self.hybrid = tuple(sorted(sim.holders["trainer"]))
        self.only_hybrid = part["rollout"] == 0
        self._size = w.batch.group_size
        sim.sample_sink = self._sample_done
        v = w.verl
        self.required = w.batch.num_samples // v.trigger_parameter_sync_step
        self.cycle = self.required * v.trigger_parameter_sync_step
        self.max_required = math.floor(self.cycle * (1.0 + v.staleness_threshold))
        policy = build_policy(
            "default",
            deactivate_ratio=v.deactivate_ratio,
            only_hybrid=self.only_hybrid,
            clamp_ratio=v.clamp_ratio,
        )
        self.controller = HybridController(
            policy,
            _Replicas(self, sim),
            sim.clock,
            num_hybrid_replicas=a // w.rollout.tp,
            enable_rebalance=v.enable_rebalance,
        )
        self._dispatch(sim)
        Task(sim.loop, self._train(sim), "verl-trainer")

    def on_reports(self, sim: Simulation, reports: Mapping[str, ComponentReport]) -> None:
        """verl's controller acts per step, not per report."""

    def on_event(self, sim: Simulation, event: SimEvent, iteration: int, index: int = 0) -> None:
        """No synchronous events in this mode."""

    # ------------------------------------------------------------- rollouter
    def _dispatch(self, sim: Simulation) -> None:
        w = sim.workload
        group = w.batch.group_size
        while self.staleness + group <= self.max_required:
            it, g = self._cursor
            trace = self._traces.get(it)
            if trace is None:
                trace = self._traces[it] = build_trace(w, it)
                self._group_tokens[it] = np.bincount(
                    trace.group, weights=trace.total_tokens, minlength=w.batch.num_prompts
                ).tolist()
            samples = [int(s) for s in range(g * group, (g + 1) * group)]
            self._group_left[(it, g)] = group
            sim.rollout.start(trace, samples)
            self.staleness += group
            self.in_flight += group
            self._cursor = (it, g + 1) if g + 1 < w.batch.num_prompts else (it + 1, 0)

    def _sample_done(self, iteration: int, sample: int) -> None:
        g = int(self._traces[iteration].group[sample])
        key = (iteration, g)
        self._group_left[key] -= 1
        if self._group_left[key]:
            return
        del self._group_left[key]
        size = self._size
        tokens = self._group_tokens[iteration][g]
        self.mq.append(Chunk(iteration, size, tokens))
        self.mq_samples += size
        self.generated += size
        self.in_flight -= size
        self._wake()

    def wait_samples(self, count: int) -> Wait:
        """A wait that fires once the message queue holds ``count`` samples."""
        wait = Wait()
        self._waiters.append((count, wait))
        self._wake()
        return wait

    def _wake(self) -> None:
        ready = [(c, w) for c, w in self._waiters if self.mq_samples >= c]
        self._waiters = [(c, w) for c, w in self._waiters if self.mq_samples < c]
        for _, wait in ready:
            wait.fire()

    # --------------------------------------------------------------- trainer
    def _take(self, count: int) -> float:
        tokens = 0.0
        while count > 0:
            head = self.mq[0]
            n = min(count, head.samples)
            share = head.tokens * n / head.samples
            tokens += share
            head.samples -= n
            head.tokens -= share
            count -= n
            self.mq_samples -= n
            if head.samples == 0:
                self.mq.popleft()
        return tokens

    def _trained(self, chunk: Chunk) -> None:
        if self._train_done is not None:
            self._train_done.fire()

    def _ctx(
        self, step: int, waits: tuple[float, ...], short: tuple[int, ...], sim: Simulation
    ) -> DynamicScheduleContext:
        expected = step * self.cycle
        return DynamicScheduleContext(
            required_samples=self.required,
            trigger_parameter_sync_step=sim.workload.verl.trigger_parameter_sync_step,
            total_generated_samples=self.generated,
            expected_samples=expected,
            buffer_samples=expected * sim.workload.verl.staleness_threshold,
            step_wait_times=waits,
            step_wait_samples=short,
            only_hybrid=self.only_hybrid,
        )

    async def _train(self, sim: Simulation) -> None:
        assert self.controller is not None
        w = sim.workload
        loop = sim.loop
        start = loop.now
        for step in range(1, w.num_iterations + 1):
            sim.iteration = step - 1
            await self.controller.before_training_step(step, self._ctx(step - 1, (), (), sim))
            waits: list[float] = []
            short: list[int] = []
            tokens = 0.0
            for _ in range(w.verl.trigger_parameter_sync_step):
                t0 = loop.now
                short.append(max(0, self.required - self.mq_samples))
                await self.wait_samples(self.required)
                waits.append(loop.now - t0)
                taken = self._take(self.required)
                self._train_done = Wait()
                sim.trainer.add(Chunk(step, self.required, taken))
                await self._train_done
                tokens += taken
            await Wait.delay(loop, w.migration.weight_sync_s)
            sim.finish_iteration(step - 1, start, loop.now, int(tokens))
            start = loop.now
            self.staleness = self.in_flight + self.mq_samples
            self._dispatch(sim)
            ctx = self._ctx(step, tuple(waits), tuple(short), sim)
            await self.controller.after_weight_sync(step, ctx)
        sim.stop()


class _Replicas:
    """The controller's operations on the hybrid replicas, carried out in the model."""

    def __init__(self, policy: VerlHybrid, sim: Simulation) -> None:
        self.policy = policy
        self.sim = sim
        assert isinstance(sim.rollout, Rollout)
        self.rollout: Rollout = sim.rollout

    def _move(self, src: str, dst: str, seconds: float) -> Wait:
        wait = Wait()
        devices = tuple(d for d in self.policy.hybrid if d in self.sim.holders[src])
        if not devices:
            wait.fire()
            return wait
        move = DeviceMove(src=src, dst=dst, devices=devices)
        self.sim.execute([move], seconds=seconds, on_done=wait.fire)
        return wait

    async def add_replicas(self) -> None:
        """Onload the replicas on the trainer's GPUs (they join routing when up)."""
        await self._move("trainer", "rollout", self.sim.workload.migration.workload_s)

    async def resume_generation_replicas(self) -> None:
        """They accept requests as soon as they are up."""

    async def remove_replicas(self) -> None:
        """Cut routing to the hybrid engines."""
        for engine in self.rollout.engines.values():
            if set(engine.devices) <= set(self.policy.hybrid):
                engine.routable = False

    async def abort_replicas(self) -> None:
        """Abort their requests; partials are retried on the standalone engines."""
        rollout = self.rollout
        hybrid = [e for e in rollout.engines.values() if not e.routable]
        rollout.resubmit(rollout.stop_engines(hybrid))

    async def sleep_replicas(self) -> None:
        """Offload and hand the GPUs back to training."""
        await self._move("rollout", "trainer", self.sim.workload.migration.workload_s)

    async def sync_hybrid_weights(self, global_steps: int) -> None:
        """Push the latest weights to the hybrid replicas."""
        await Wait.delay(self.sim.loop, self.sim.workload.migration.weight_sync_s)

    async def wait_for_samples(self, count: int) -> None:
        """Until the message queue holds ``count`` samples."""
        await self.policy.wait_samples(count)

    async def rebalance(self) -> None:
        """Abort everything in flight and spread it over all routable engines."""
        self.rollout.rebalance()
