"""Asynchronous GRPO on the reference backend, with hybrid rollout replicas (verl-style).

Devices: the first ``num_standalone_devices`` run standalone rollout engines (always
generating); the others hold the trainer — and, under the hybrid controller, a hybrid
rollout replica each while the trainer would wait for data. Three tasks share the
driver's loop:

* the **producer** starts prompt groups (``group_size`` episodes of one problem) while
  the :class:`~dynarl.backends.reference.MessageQueue` has room (buffered plus in generation), and
  submits their turns while the rollout holds fewer than ``servers × s`` of them (s:
  ``concurrent_samples_per_replica``), so a newly activated replica gets work at once;
  a group dropped for staleness is started again first;
* the **collector** folds every finished turn into its episode (tool calls run here),
  and puts a complete, scored group (GRPO advantages computed) into the queue;
* the **trainer loop**, per step: the :class:`~dynarl.sched.HybridController`'s
  ``before_training_step`` (the policy may wait for ``deactivate_wait_samples`` and
  deactivate: remove → abort → sleep); a batch of ``num_groups`` admissible groups from
  the queue (waiting if needed); ``learn`` with the log-probs the samples were generated
  with (off-policy ratios) and one optimizer step (weight version += 1); weight sync to
  the standalone engines (they switch versions between two decoding steps, so requests in
  flight continue with the new weights); ``after_weight_sync`` (the policy may sync the
  hybrid replicas and activate them: sync → add → resume → rebalance). The
  ``dynamic_resource/*`` metrics (:class:`~dynarl.sched.DynamicResourceMetrics`) are
  computed per step.

The standalone-only run is the same driver with the ``static_fully_async`` policy and no
hybrid replica. Runs on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from dynarl.backends.reference import (
    GROUP,
    SEED_ID,
    Episodes,
    JobReplicas,
    MessageQueue,
    Problem,
    ReferenceSetup,
    ToolCall,
    ToolWorker,
    meta_float,
)
from dynarl.bus import GenerationRequest, Sample
from dynarl.demo._async_records import AsyncConfig, AsyncStepReport
from dynarl.errors import BackendError, DeadlineExceeded
from dynarl.runtime import VERSIONS, Job
from dynarl.sched import (
    DynamicResourceMetrics,
    DynamicScheduleContext,
    HybridController,
    MonotonicClock,
    RolloutUtilization,
    build_policy,
)

__all__ = ["AsyncGRPODriver"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Group:
    episodes: Episodes
    problem: Problem


class AsyncGRPODriver:
    """Asynchronous GRPO on ``job`` (see the module docstring). Raises BackendError when
    a generation, a call or a move fails."""

    def __init__(
        self,
        job: Job,
        setup: ReferenceSetup,
        config: AsyncConfig,
        *,
        observer: Callable[[AsyncStepReport], None] | None = None,
    ) -> None:
        self.job, self.setup, self.config = job, setup, config
        self.observer = observer
        """Called with every step's report."""
        devices = tuple(range(config.num_devices))
        self.standalone = devices[: config.num_standalone_devices]
        self.trainer_devices = devices[config.num_standalone_devices :]
        self.task = setup.make_task()
        self.tool = ToolWorker(latency=setup.tool_latency, seed=setup.seed)
        self.version = 0
        self.clock = MonotonicClock()
        self.queue = MessageQueue(
            capacity_samples=config.queue_samples(setup.group_size),
            max_staleness=config.max_staleness,
            regenerate=self._regenerate,
        )
        self.replicas = JobReplicas(
            job,
            standalone=self.standalone,
            hybrid=self.trainer_devices,
            version=lambda: self.version,
            wait_for_samples=self.queue.wait_for_samples,
            on_change=self._capacity_changed,
        )
        policy = build_policy(
            config.policy if config.hybrid else "static_fully_async",
            deactivate_ratio=config.deactivate_ratio,
        )
        self.controller = HybridController(
            policy,
            self.replicas,
            self.clock,
            num_hybrid_replicas=len(self.trainer_devices) if config.hybrid else 0,
            enable_rebalance=config.enable_rebalance,
        )
        self.metrics = DynamicResourceMetrics(
            hybrid_devices=len(self.trainer_devices), standalone_devices=len(self.standalone)
        )
        self.utilization = RolloutUtilization()
        self._groups: dict[int, _Group] = {}
        self._retry: collections.deque[Problem] = collections.deque()
        self._finished: dict[int, Problem] = {}
        """Problems of groups in the queue (a dropped one is generated again)."""
        self._next_problem = 0
        self._generation = 0
        self._inflight = 0
        self._room = asyncio.Event()
        self.origin = self.clock.now()
        """When the run started (the clock's time)."""

    # ------------------------------------------------------------------ rollout side

    @property
    def capacity(self) -> int:
        """cap = min(servers × s, maxReq): turns the rollout may hold now."""
        servers = len(self.replicas.dispatcher.workers)
        return min(servers * self.config.concurrent_samples_per_replica, self.max_required)

    @property
    def max_required(self) -> int:
        """maxReq: the most samples in generation (the queue's capacity)."""
        return self.queue.capacity_samples

    def _capacity_changed(self) -> None:
        self._record_load()
        self._room.set()

    def _record_load(self) -> None:
        self.utilization.record(self.clock.now(), self._inflight, self.capacity)

    def _regenerate(self, group: list[Sample]) -> None:
        seed_id = group[0].metadata.get(SEED_ID)
        key = int(seed_id) // self.setup.group_size if isinstance(seed_id, int) else -1
        entry = self._finished.pop(key, None)
        if entry is None:
            raise BackendError(f"dropped group {group[0].prompt_id} has no problem on record")
        self._retry.append(entry)
        self._room.set()

    def _problem(self) -> Problem:
        if self._retry:
            return self._retry.popleft()
        n = self.config.num_groups
        index, self._next_problem = self._next_problem, self._next_problem + 1
        return self.task.problems(step=index // n, num_problems=n)[index % n]

    async def _produce(self) -> None:
        """Start groups while the queue has room; submit turns while capacity lasts."""
        while True:
            problem = self._problem()
            await self.queue.reserve(self.setup.group_size)
            episodes = Episodes(self.setup, self.task, self._generation, [problem])
            self._generation += 1
            self._groups[problem.problem_id] = _Group(episodes=episodes, problem=problem)
            for request in episodes.first_requests():
                await self._wait_room()
                self._submit([request])

    async def _wait_room(self) -> None:
        while self._inflight >= self.capacity:
            self._room.clear()
            try:
                async with asyncio.timeout(0.5):
                    await self._room.wait()
            except TimeoutError:
                pass

    def _submit(self, requests: list[GenerationRequest]) -> None:
        self._inflight += len(requests)
        self.job.submit("rollout", requests)
        self._record_load()

    async def _collect(self, group: asyncio.TaskGroup) -> None:
        """Fold finished turns in; complete groups go to the queue."""
        output = self.job.output("rollout")
        while True:
            try:
                sample = await output.get(timeout=self.config.item_timeout_s)
            except DeadlineExceeded as exc:
                raise BackendError(f"no generation finished in {exc}") from exc
            self._inflight -= 1
            self._record_load()
            self._room.set()
            if sample.metadata.get("finish") == "error":
                raise BackendError(f"generation {sample.sample_id} failed: {sample.metadata}")
            seed_id = sample.metadata.get(SEED_ID)
            key = int(seed_id) // self.setup.group_size if isinstance(seed_id, int) else -1
            entry = self._groups.get(key)
            if entry is None:
                raise BackendError(f"sample {sample.sample_id} belongs to no running group")
            call = entry.episodes.absorb(sample)
            if call is not None:
                self._inflight += 1  # the next turn is on its way
                group.create_task(self._call_tool(entry.episodes, call))
            if entry.episodes.complete_groups():
                del self._groups[key]
                self._finished[key] = entry.problem
                await self.queue.put(entry.episodes.micro_batch(0))

    async def _call_tool(self, episodes: Episodes, call: ToolCall) -> None:
        result = await self.tool.call(call.expression, call_id=call.call_id)
        request = episodes.tool_result(call, result.output)
        self._inflight -= 1
        if request is not None:
            self._submit([request])

    # ------------------------------------------------------------------ trainer side

    def _context(
        self, step: int, waits: tuple[float, ...], waited: tuple[int, ...]
    ) -> DynamicScheduleContext:
        required = self.config.num_groups * self.setup.group_size
        return DynamicScheduleContext(
            required_samples=required,
            trigger_parameter_sync_step=1,
            total_generated_samples=self.queue.generated_samples,
            expected_samples=step * required,
            buffer_samples=step * required * self.config.staleness_threshold,
            step_wait_times=waits,
            step_wait_samples=waited,
            only_hybrid=False,
        )

    async def run(self, num_steps: int) -> list[AsyncStepReport]:
        """``num_steps`` training steps; their reports."""
        self.origin = self.clock.now()
        self._record_load()
        async with asyncio.TaskGroup() as group:
            producer = group.create_task(self._produce())
            collector = group.create_task(self._collect(group))
            try:
                # The initial weights count as the first sync: the policy may activate.
                await self.controller.after_weight_sync(0, self._context(0, (), ()))
                reports = [await self._train_step(step) for step in range(num_steps)]
            finally:
                producer.cancel()
                collector.cancel()
        return reports

    async def _train_step(self, step: int) -> AsyncStepReport:
        began = self.clock.now()
        global_steps = step + 1
        before = await self.controller.before_training_step(
            global_steps, self._context(step, (), ())
        )
        if not self.job.allocation.devices("trainer"):
            raise BackendError("the policy kept the hybrid replicas active: nothing trains")
        required = self.config.num_groups * self.setup.group_size
        start, buffered = self.clock.now(), self.queue.size
        groups = await self.queue.take(self.config.num_groups, self.version)
        wait_s, wait_samples = self.clock.now() - start, max(0, required - buffered)
        trainer_version = self.version
        for taken in groups:
            seed_id = taken[0].metadata.get(SEED_ID)
            if isinstance(seed_id, int):
                self._finished.pop(seed_id // self.setup.group_size, None)
        batch = [_in_micro(s, i) for i, g in enumerate(groups) for s in g]
        mark = self.clock.now()
        await self.job.call("trainer", "learn", batch, num_samples=len(batch), old="rollout")
        results = await self.job.call(
            "trainer", "step", num_micros=len(groups), num_samples=len(batch)
        )
        stats = dict(results[0].values)
        update_s = self.clock.now() - mark
        version = stats.get("version")
        self.version = int(version) if isinstance(version, int) else self.version + 1
        mark = self.clock.now()
        await self._sync(global_steps)
        sync_s = self.clock.now() - mark
        ctx = self._context(global_steps, (wait_s,), (wait_samples,))
        after = await self.controller.after_weight_sync(global_steps, ctx)
        end = self.clock.now()
        self.metrics.add_step(
            timing={"update_actor": update_s},
            allocated_s=end - began,
            step_s=end - began,
            wait_for_samples_s=before.wait_for_samples_s,
            mq_size=self.queue.size,
        )
        cycle = self.metrics.cycle(self.utilization.close(end))
        rewards = tuple(float(s.reward or 0.0) for s in batch)
        report = AsyncStepReport(
            step=step,
            trainer_version=trainer_version,
            version=self.version,
            mean_reward=sum(rewards) / len(rewards),
            rewards=rewards,
            loss=meta_float(stats.get("loss")),
            kl=meta_float(stats.get("kl")),
            sample_ids=tuple(s.sample_id for s in batch),
            versions=tuple(str(s.metadata.get(VERSIONS, "")) for s in batch),
            resumed=tuple(int(s.metadata.get("resumed", 0) or 0) for s in batch),
            began_s=began - self.origin,
            wall_s=end - began,
            wait_s=wait_s,
            update_s=update_s,
            sync_s=sync_s,
            deactivate_s=before.deactivate_s,
            wait_for_samples_s=before.wait_for_samples_s,
            activate_s=after.activate_s,
            hybrid_active=self.controller.is_hybrid_active,
            metrics=cycle,
        )
        if self.observer is not None:
            self.observer(report)
        logger.info(
            "async step %d: reward %.3f, waited %.2f s, hybrid %s, mq %d",
            step,
            report.mean_reward,
            wait_s,
            report.hybrid_active,
            self.queue.size,
        )
        return report

    async def _sync(self, global_steps: int) -> None:
        """The new weights to the standalone engines (planned by the migrate planner)."""
        targets = ",".join(map(str, self.standalone))
        trainer = ",".join(map(str, self.job.allocation.devices("trainer")))
        tag = f"async-s{global_steps}-v{self.version}"
        await asyncio.gather(
            self.job.call("trainer", "sync_weights", rollout=targets, tag=tag),
            self.job.call(
                "rollout",
                "receive_weights",
                trainer=trainer,
                rollout=targets,
                tag=tag,
                version=self.version,
            ),
        )


def _in_micro(sample: Sample, index: int) -> Sample:
    """``sample`` as part of micro-batch ``index`` of a training batch."""
    return msgspec.structs.replace(sample, metadata={**sample.metadata, GROUP: index})
