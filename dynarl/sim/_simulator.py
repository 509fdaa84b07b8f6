"""The simulation: rollout, inference and trainer on a virtual clock, driven by a policy.

A :class:`Simulation` owns the event loop, the components and the devices. In the
synchronous mode (every policy but verl-hybrid) an iteration dispatches its batch to
rollout; a finished GRPO group goes to log-prob inference, then to the trainer; the
trainer's mini-batch boundaries and the iteration's end (followed by the weight sync,
a barrier, where dynamic policies :meth:`~Simulation.restore` their iteration-start
allocation) are announced to the policy. Every ``report_interval_s`` each component
reports as its group manager would, and the policy sees the reports. A policy changes
the allocation only through :meth:`Simulation.execute`, which runs device moves with the
modelled migration pause: donors lose their devices at once (rollout requests are
re-submitted with their partial output), receivers get them when the pause ends, and a
P2P-resharded trainer makes no progress meanwhile. The asynchronous mode hands the
sample flow to the policy (verl fully-async). Single-threaded; each run is bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from dynarl.bus import ComponentReport
from dynarl.errors import DynarlError
from dynarl.sched import DeviceMove, FifoPolicy, RequestPolicy, place
from dynarl.sim._components import (
    COMPONENTS,
    ModelledMigrationCost,
    RolloutModel,
    SimEvent,
    SimPolicy,
    build_nodes,
)
from dynarl.sim._event_loop import EventLoop
from dynarl.sim._results import GpuAccounts, IterationStats, RunResult, Timeline, summarise
from dynarl.sim._rollout import Rollout
from dynarl.sim._stage import Chunk, Stage
from dynarl.sim._trace import IterationTrace, build_trace
from dynarl.sim._workload_file import Workload
from dynarl.types import Allocation, ComponentKind

__all__ = ["Simulation"]


class Simulation:
    """One policy on one workload (see the module docstring)."""

    def __init__(
        self,
        workload: Workload,
        *,
        request_policy: Callable[[], RequestPolicy] = FifoPolicy,
        rollout_factory: Callable[..., RolloutModel] | None = None,
    ) -> None:
        self.workload = workload
        self.loop = EventLoop()
        self.clock = self.loop.clock
        factory: Callable[..., RolloutModel] = rollout_factory or Rollout
        self.rollout: RolloutModel = factory(
            workload, self.loop, request_policy, self._sample_done, self._samples_done
        )
        self.inference = Stage(
            "inference",
            ComponentKind.INFERENCE.value,
            workload.inference,
            self.loop,
            self._inferred,
        )
        self.trainer = Stage(
            "trainer", ComponentKind.TRAINER.value, workload.trainer, self.loop, self._trained
        )
        self.cost = ModelledMigrationCost(
            spec=workload.migration,
            sharded_state_fraction=workload.model.sharded_state_fraction,
        )
        self.nodes = build_nodes(workload)
        self.holders: dict[str, set[int]] = {name: set() for name in COMPONENTS}
        self.free: set[int] = set(range(workload.cluster.num_gpus))
        self.transit: dict[int, str | None] = {}
        self.timeline = Timeline(
            components=(*COMPONENTS, "transit", "free"),
            num_warmup_iterations=workload.num_warmup_iterations,
        )
        self.iterations: list[IterationStats] = []
        self.iteration = -1
        self.trace: IterationTrace | None = None
        self.policy: SimPolicy | None = None
        self.accounts = GpuAccounts()
        self.moves_per_iteration: dict[int, int] = {}
        self.sample_sink: Callable[[int, int], None] | None = None
        self._group_left = np.zeros(0, dtype=np.int64)
        self._group_tokens = np.zeros(0, dtype=np.int64)
        self._iter_start = 0.0
        self._rolled = self._inferred_n = self._trained_n = 0
        self._next_boundary = 0
        self.finished = False

    # -------------------------------------------------------------- devices
    @property
    def allocation(self) -> Allocation:
        """Devices each component holds (devices in transit belong to none)."""
        return Allocation.of({name: sorted(devs) for name, devs in self.holders.items()})

    def counts(self) -> dict[str, int]:
        """Devices per component, plus ``transit`` and ``free``."""
        out = {name: len(devs) for name, devs in self.holders.items()}
        out["transit"] = len(self.transit)
        out["free"] = len(self.free)
        return out

    def _record(self) -> None:
        self.timeline.record(self.loop.now, self.counts())

    def assign(self, sizes: Mapping[str, int]) -> None:
        """Place ``sizes`` on free devices at once (set-up, no pause)."""
        moves = place(
            self.allocation,
            sorted(self.free),
            {n: sizes.get(n, 0) + len(self.holders[n]) for n in COMPONENTS},
            self.nodes,
            self.workload.cluster.num_gpus_per_node,
        )
        for move in moves:
            assert move.src is None and move.dst is not None
            self.free -= set(move.devices)
            self._give(move.dst, move.devices)
        self._record()

    def _give(self, name: str, devices: Sequence[int]) -> None:
        self.holders[name] |= set(devices)
        if name == "rollout":
            self.rollout.add_devices(devices)
        else:
            self._stage(name).set_devices(len(self.holders[name]))

    def _stage(self, name: str) -> Stage:
        return self.inference if name == "inference" else self.trainer

    def execute(
        self,
        moves: Sequence[DeviceMove],
        *,
        seconds: float | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> float:
        """Carry out ``moves``; returns the pause. Raises ValueError for a device not held.

        ``seconds`` overrides the modelled cost (a colocated stage switch).
        """
        now = self.loop.now
        old = {n: len(d) for n, d in self.holders.items()}
        new = dict(old)
        for move in moves:
            for d in move.devices:
                held = self.free if move.src is None else self.holders[move.src]
                if d not in held:
                    raise ValueError(f"device {d} is not held by {move.src or 'the free pool'}")
            if move.src is not None:
                new[move.src] -= len(move.devices)
            if move.dst is not None:
                new[move.dst] += len(move.devices)
        modelled = seconds is None
        if seconds is None:
            seconds = self.cost.move_seconds(self.nodes, old, new)
        for move in moves:
            self._take(move.src, move.devices)
            for d in move.devices:
                self.transit[d] = move.dst
        if modelled and new["trainer"] != old["trainer"] and old["trainer"]:
            self.trainer.pause(self.cost.seconds(self.nodes["trainer"].migration))
        self.moves_per_iteration[self.iteration] = (
            self.moves_per_iteration.get(self.iteration, 0) + 1
        )
        self._record()
        self.loop.at(now + seconds, lambda: self._arrive(moves, on_done))
        return seconds

    def restore(self, sizes: Mapping[str, int], *, on_done: Callable[[], None]) -> float:
        """The barrier rule: back to ``sizes`` (placed by ``dynarl.sched.place``) at the
        modelled cost, overlapping the weight sync; ``on_done`` runs on arrival. Returns
        the pause."""
        per_node = self.workload.cluster.num_gpus_per_node
        wanted = {name: sizes.get(name, 0) for name in COMPONENTS}
        moves = place(self.allocation, sorted(self.free), wanted, self.nodes, per_node)
        if not moves:
            on_done()
            return 0.0
        return self.execute(moves, on_done=on_done)

    def _take(self, src: str | None, devices: Sequence[int]) -> None:
        if src is None:
            self.free -= set(devices)
            return
        self.holders[src] -= set(devices)
        if src == "rollout":
            for rest in self.rollout.remove_devices(devices):
                self.rollout.add_devices(rest)
        else:
            self._stage(src).set_devices(len(self.holders[src]))

    def _arrive(self, moves: Sequence[DeviceMove], on_done: Callable[[], None] | None) -> None:
        for move in moves:
            for d in move.devices:
                self.transit.pop(d, None)
            if move.dst is None:
                self.free |= set(move.devices)
            else:
                self._give(move.dst, move.devices)
        self._record()
        if on_done is not None:
            on_done()

    # ------------------------------------------------------------ iterations
    def start_iteration(self, index: int) -> None:
        """Dispatch iteration ``index``'s batch (synchronous mode)."""
        w = self.workload
        self.iteration = index
        self.trace = build_trace(w, index)
        self._iter_start = self.loop.now
        self.timeline.iteration_starts.append(self.loop.now)
        self._group_left = np.full(w.batch.num_prompts, w.batch.group_size, dtype=np.int64)
        self._group_tokens = np.bincount(
            self.trace.group, weights=self.trace.total_tokens, minlength=w.batch.num_prompts
        ).astype(np.int64)
        self._rolled = self._inferred_n = self._trained_n = 0
        self._next_boundary = 1
        for part in (self.rollout, self.inference, self.trainer):
            part.new_iteration()
        if index == 0:
            per_item = float(self.trace.total_tokens.mean())  # the profiled mean
            self.inference.tokens_per_item = self.trainer.tokens_per_item = per_item
        self.rollout.start(self.trace)
        self._notify(SimEvent.ITERATION_START, index)

    def remaining(self) -> dict[str, int]:
        """Items of the current iteration each component has yet to finish."""
        n = self.workload.batch.num_samples
        return {
            "rollout": n - self._rolled,
            "inference": n - self._inferred_n,
            "trainer": n - self._trained_n,
        }

    def pending(self) -> dict[str, int]:
        """Items each component holds now, queued or in flight (what its report says).

        Rollout holds every unfinished sample of the batch from the start; inference and
        the trainer hold only what has reached them (``ComponentReport.remaining``; why
        not the whole batch: docs/workloads.md, "Reports").
        """
        return {
            "rollout": self.rollout.unfinished,
            "inference": self.inference.queued_samples,
            "trainer": self.trainer.queued_samples,
        }

    def _notify(self, event: SimEvent, iteration: int, index: int = 0) -> None:
        if self.policy is not None:
            self.policy.on_event(self, event, iteration, index)

    def _sample_done(self, iteration: int, sample: int) -> None:
        if self.sample_sink is not None:
            self.sample_sink(iteration, sample)
            return
        assert self.trace is not None and iteration == self.iteration
        self._rolled += 1
        g = int(self.trace.group[sample])
        self._group_left[g] -= 1
        if self._group_left[g] == 0:
            size = self.workload.batch.group_size
            self.inference.add(Chunk(iteration, size, float(self._group_tokens[g])))
        if self._rolled == self.workload.batch.num_samples:
            self._notify(SimEvent.ROLLOUT_DONE, iteration)

    def _samples_done(self, iteration: int, samples: npt.NDArray[np.int64]) -> None:
        """Many samples finished at once (the vector model): completed groups go on together."""
        if self.sample_sink is not None:
            for sample in samples.tolist():
                self.sample_sink(iteration, sample)
            return
        assert self.trace is not None and iteration == self.iteration
        w = self.workload
        self._rolled += int(samples.shape[0])
        counts = np.bincount(self.trace.group[samples], minlength=w.batch.num_prompts)
        self._group_left -= counts
        complete = np.flatnonzero((self._group_left == 0) & (counts > 0))
        if complete.size:
            tokens = float(self._group_tokens[complete].sum())
            self.inference.add(Chunk(iteration, int(complete.size) * w.batch.group_size, tokens))
        if self._rolled == w.batch.num_samples:
            self._notify(SimEvent.ROLLOUT_DONE, iteration)

    def _inferred(self, chunk: Chunk) -> None:
        self._inferred_n += chunk.samples
        self.trainer.add(Chunk(chunk.iteration, chunk.samples, chunk.tokens))
        if self._inferred_n == self.workload.batch.num_samples:
            self._notify(SimEvent.INFERENCE_DONE, chunk.iteration)

    def _trained(self, chunk: Chunk) -> None:
        b = self.workload.batch
        self._trained_n += chunk.samples
        per = b.num_samples // b.num_minibatches
        while (
            self._next_boundary <= b.num_minibatches
            and self._trained_n >= self._next_boundary * per
        ):
            index = self._next_boundary
            self._next_boundary += 1
            if index < b.num_minibatches:
                self._notify(SimEvent.MINIBATCH, chunk.iteration, index)
        if self._trained_n == b.num_samples:
            self._end_iteration()

    def _end_iteration(self) -> None:
        assert self.trace is not None
        tokens = int(self.trace.total_tokens.sum())
        sync = self.workload.migration.weight_sync_s
        self.finish_iteration(self.iteration, self._iter_start, self.loop.now + sync, tokens)
        self._notify(SimEvent.ITERATION_END, self.iteration)
        if self.iteration + 1 < self.workload.num_iterations:
            nxt = self.iteration + 1
            self.loop.after(sync, lambda: self.start_iteration(nxt))
        else:
            self.loop.after(sync, self.stop)

    def finish_iteration(self, index: int, start: float, end: float, tokens: int) -> None:
        """Record an iteration's figures (the asynchronous policies call this too)."""
        self.iterations.append(
            IterationStats(
                index=index,
                start=start,
                end=end,
                samples=self.workload.batch.num_samples,
                tokens=tokens,
            )
        )

    def stop(self) -> None:
        """End the run."""
        self.finished = True
        self.timeline.end = self.loop.now
        self.loop.stop()

    # ---------------------------------------------------------------- reports
    def reports(self) -> dict[str, ComponentReport]:
        """Every component's report for the interval that ends now."""
        it = max(self.iteration, 0)
        # Rollout's report first: a lazy (vectorised) model catches up to now in it, and
        # the samples it finished meanwhile count in every figure.
        rollout = self.rollout.report(remaining=0, iteration=it)
        remaining = self.pending()
        return {
            "rollout": msgspec.structs.replace(rollout, remaining=remaining["rollout"]),
            "inference": self.inference.report(remaining=remaining["inference"], iteration=it),
            "trainer": self.trainer.report(remaining=remaining["trainer"], iteration=it),
        }

    def _tick(self) -> None:
        reports = self.reports()
        self._account(reports)
        if self.policy is not None:
            self.policy.on_reports(self, reports)
        if not self.finished:
            self.loop.after(self.workload.report_interval_s, self._tick)

    def _account(self, reports: Mapping[str, ComponentReport]) -> None:
        dt = reports["rollout"].interval_s
        busy = float(self.rollout.busy_devices())
        migrating = float(len(self.transit))
        for stage in (self.inference, self.trainer):
            report = reports[stage.name]
            if self.loop.now < stage.paused_until:
                migrating += stage.num_devices
            elif report.utilization:
                busy += float(np.mean(report.utilization)) * stage.num_devices
        total = float(self.workload.cluster.num_gpus)
        idle = max(total - busy - migrating, 0.0)
        self.accounts.add(self.iteration, busy * dt, idle * dt, migrating * dt)

    # -------------------------------------------------------------------- run
    def run(self, policy: SimPolicy) -> RunResult:
        """Simulate ``workload.num_iterations`` iterations under ``policy``.

        Raises DynarlError when the run does not finish within its event and time bounds.
        """
        w = self.workload
        self.policy = policy
        policy.setup(self)
        if not policy.asynchronous:
            self.start_iteration(0)
        self.loop.after(w.report_interval_s, self._tick)
        turns = w.agentic.max_tool_calls + 1 if w.agentic else 1
        bound = 200 * w.num_iterations * w.batch.num_samples * turns + 10_000_000
        horizon = 1e7
        self.loop.run(until=horizon, max_events=bound)
        if not self.finished:
            raise DynarlError(f"{policy.name} did not finish {w.name} by t={horizon} s")
        return self.result(policy.name)

    def result(self, policy: str) -> RunResult:
        """The run's figures over the measured iterations (raises DynarlError without any)."""
        return summarise(
            policy=policy,
            workload=self.workload,
            iterations=self.iterations,
            accounts=self.accounts,
            moves_per_iteration=self.moves_per_iteration,
            prefill=self.rollout.totals(),
            timeline=self.timeline,
        )
