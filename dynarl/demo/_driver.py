"""The GRPO loop of a reference job on the runtime, under a device schedule.

:class:`GRPODriver` runs on-policy GRPO steps on a :class:`dynarl.Job` made by
:func:`reference_components`: the rollout component generates every episode of a step
(multi-turn tool calls run in the driver, the calculator's latency a wait), each prompt
group becomes one micro-batch as soon as its episodes are scored, and the trainer learns
the micro-batches whenever it holds devices (``ReferenceTrainer.learn``); once the last
episode is in, the trainer takes the step (rows summed in micro-batch order), syncs the
weights to the rollout engines, and the devices go back to the rollout. What the step
computes — its samples, micro-batches, update order, and in deterministic mode every
token, reward and parameter — is the same under every :class:`Schedule`:

* ``sequential``: every device generates, then every device trains (DP over all), then
  every device generates again (roles switch at the barriers, sleeping with their state);
* ``split``: a fixed partition — ``num_rollout_devices`` generate, the others train
  (learning micro-batches while the rollout runs), no moves at all;
* ``dynarl``: while the rollout runs the scheduler may take devices from it (tool waits
  and a tail leave engines idle) and give them to the trainer, which starts learning the
  complete micro-batches at once; at the barrier the trainer grows onto every device by
  P2P migration when the learning time that saves exceeds the cost of a grow and a
  shrink (both measured in the run) and shrinks back to its home device after the step.
  By default every rollout starts on every device, like sequential; with
  ``resume_where_left`` a rollout starts where the scheduler left the trainer (on its
  home device if the scheduler had given it one, else on no device), the first one
  where the trainer was created, on its home device. The scheduler
  acts only during the rollout phase (observe-only otherwise, so it never races the
  barrier). Every trainer reshard the driver makes is checked: the state's checksum is
  the same before and after.

Every move is a real migration through the runtime's coordinator and ledger; where the
devices go at each switch is decided and carried out by
:mod:`~dynarl.demo._phase_moves`.

The same loop drives real engines and the Megatron trainer (``dynarl demo --engine vllm``):
given :class:`EngineWeights`, the trainer pushes its weights to every engine after each step
(and its initial weights before the first: the engines are reloaded for each run), the
rollout labels the version, and every learn call also measures how far the engines'
log-probs of the learned tokens are from the trainer's. Every step reports the tokens it
trained on that carry another weight version than the one its rollout was served under
(``StepReport.stale_tokens``: 0 on-policy) and keeps the samples it trained on, in update
order (:attr:`GRPODriver.trained`), for a replay. Runs on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

from dynarl.backends.reference import Episodes, ReferenceSetup, ToolCall, ToolWorker, meta_float
from dynarl.bus import MetaValue, Sample
from dynarl.demo._device_schedules import DriverProgress, RunPlan, Schedule, StepReport
from dynarl.demo._phase_moves import DeviceMover
from dynarl.errors import BackendError
from dynarl.runtime import CallResult, Job, stale_tokens

__all__ = ["EngineWeights", "GRPODriver"]

logger = logging.getLogger(__name__)


Observer = Callable[[DriverProgress], None]


class EngineWeights:
    """How weights reach real engines: the trainer pushes to every engine (``targets``: the
    ``engines`` option of ``MegatronTrainerRole.push_weights``, every device's engine, so
    engines asleep or not in the rollout now are current when they serve again) and the
    rollout labels the version it serves."""

    def __init__(self, targets: str) -> None:
        self.targets = targets

    async def push(self, job: Job, version: int) -> None:
        """The trainer's weights to every engine as ``version`` (the trainer holds devices)."""
        await job.call("trainer", "push_weights", engines=self.targets, version=version)

    async def label(self, job: Job, version: int) -> None:
        """The rollout's engines serve ``version`` from now on (no-op without devices)."""
        if job.allocation.devices("rollout"):
            await job.call("rollout", "set_weight_version", version=version)


class GRPODriver:
    """GRPO steps on ``job`` under ``plan`` (see the module docstring).

    ``chunk_micros``: micro-batches one trainer rank learns per call (short calls let a
    move of the trainer start soon). ``observer`` is called on every change of progress.
    ``resume_where_left`` (dynarl): see the attribute; ``move_cost_s``, ``always_grow``
    (dynarl): see :class:`~dynarl.demo._phase_moves.DeviceMover`. Raises
    ValueError on a count below 1 or a negative cost.
    """

    def __init__(
        self,
        job: Job,
        setup: ReferenceSetup,
        plan: RunPlan,
        *,
        num_prompts: int,
        chunk_micros: int = 1,
        observer: Observer | None = None,
        resume_where_left: bool = False,
        move_cost_s: float = 0.2,
        always_grow: bool = False,
        weights: EngineWeights | None = None,
    ) -> None:
        if num_prompts < 1 or chunk_micros < 1:
            raise ValueError("GRPODriver needs num_prompts >= 1 and chunk_micros >= 1")
        if move_cost_s < 0:
            raise ValueError(f"GRPODriver needs move_cost_s >= 0, got {move_cost_s}")
        self.job, self.setup, self.plan = job, setup, plan
        self.num_prompts, self.chunk_micros = num_prompts, chunk_micros
        self.observer = observer
        self.resume_where_left = resume_where_left
        """dynarl: start a rollout with the trainer where the scheduler had put it when
        the last rollout ended (False: every rollout starts on every device)."""
        self.task = setup.make_task()
        self.tool = ToolWorker(latency=setup.tool_latency, seed=setup.seed)
        self.version = 0
        self._phase, self._step = "switch", 0
        self._episodes: Episodes | None = None
        self._learned: set[int] = set()
        self._final = False
        self._turns = 0
        self._left = False
        self._micro_s: float | None = None
        """Seconds one trainer rank took per micro-batch in its last learn call."""
        self.weights = weights
        """Real engines' weight path (None: the reference engines' sync)."""
        self._gap: float | None = None
        """This step's largest engine-vs-trainer log-prob gap (real engines only)."""
        self.trained: list[tuple[Sample, ...]] = []
        """Per step, the samples trained on in update order (micro-batch order)."""
        self._mover = DeviceMover(
            job,
            plan,
            on_move=self._progress,
            checksum=self._checksum,
            move_cost_s=move_cost_s,
            always_grow=always_grow,
        )
        """Carries out the phase switches (:mod:`~dynarl.demo._phase_moves`)."""

    @property
    def reshards_verified(self) -> int:
        """Trainer reshards whose state checksum was checked equal before and after."""
        return self._mover.reshards_verified

    # ------------------------------------------------------------------ phases

    async def prepare(self) -> None:
        """Put the devices in the rollout phase (before the first step's clock starts).

        dynarl with ``resume_where_left``: the first rollout starts where the components
        were created — the trainer on its home device, where it made its state — as
        every later rollout starts where the scheduler left the trainer; the scheduler
        moves from there.
        """
        if self.plan.schedule is Schedule.DYNARL and self.resume_where_left:
            self._left = True
        if self.weights is not None:  # the engines reloaded with the trainer's first weights
            await self.weights.push(self.job, self.version)
        await self._enter_rollout()
        await self._check_versions()

    def _progress(self, phase: str | None = None) -> None:
        if phase is not None:
            self._phase = phase
        if self.observer is None:
            return
        eps = self._episodes
        self.observer(
            DriverProgress(
                step=self._step,
                phase=self._phase,
                done=eps.num_done if eps is not None else 0,
                total=eps.num_samples if eps is not None else 0,
                learned=len(self._learned),
                num_micros=eps.num_groups if eps is not None else 0,
                allocation=self.job.allocation.as_dict(),
            )
        )

    async def _enter_rollout(self) -> None:
        self._progress("switch")
        await self._mover.enter_rollout(resume=self.resume_where_left and self._left)
        if self.weights is not None:
            await self.weights.label(self.job, self.version)

    async def _checksum(self) -> str:
        results = await self.job.call("trainer", "checksum")
        return str(_agreed(results, "checksum").values.get("checksum"))

    async def _check_versions(self) -> None:
        results = await self.job.call("rollout", "weight_version")
        stale = {r.device: r.values.get("version") for r in results}
        if any(v != self.version for v in stale.values()):
            raise BackendError(f"rollout engines hold versions {stale}, expected {self.version}")

    # ------------------------------------------------------------------ a step

    async def train_step(self, step: int) -> StepReport:
        """Run GRPO step ``step``; raises BackendError when a move, a call or a sample fails."""
        began = time.perf_counter()
        self._step, self._learned, self._final = step, set(), False
        self._turns, self._gap = 0, None
        served = self.version
        dynarl = self.plan.schedule is Schedule.DYNARL
        problems = self.task.problems(step=step, num_problems=self.num_prompts)
        episodes = self._episodes = Episodes(self.setup, self.task, step, problems)
        ready: list[int] = []
        changed = asyncio.Event()
        self.job.new_iteration()
        # The trainer's work of this iteration: every micro-batch, complete or not yet.
        self.job.set_remaining("trainer", episodes.num_groups)
        self._progress("rollout")
        if dynarl:
            self.job.operator("act", "rollout phase")
        self.job.submit("rollout", episodes.first_requests())
        phases: dict[str, float] = {}
        async with asyncio.TaskGroup() as group:
            learner = group.create_task(self._learn(episodes, ready, changed))
            await self._collect(episodes, ready, changed, group)
            phases["rollout"] = time.perf_counter() - began
            self._left = bool(self.job.allocation.devices("trainer"))
            learned_early = len(self._learned)
            if dynarl:
                self.job.operator("observe_only", "learner phase")
            mark = time.perf_counter()
            self._progress("learn")
            await self._mover.enter_learner(
                episodes.num_groups - len(self._learned), micro_s=self._micro_s
            )
            phases["barrier"] = time.perf_counter() - mark
            self._final = True
            changed.set()
            await learner
        mark = time.perf_counter()
        phases["learn"] = mark - began - phases["rollout"] - phases["barrier"]
        stats = await self._apply(episodes)
        phases["step"] = time.perf_counter() - mark
        mark = time.perf_counter()
        await self._sync(step)
        phases["sync"] = time.perf_counter() - mark
        mark = time.perf_counter()
        await self._enter_rollout()
        await self._check_versions()
        phases["switch"] = time.perf_counter() - mark
        return self._record(step, episodes, stats, began, phases, learned_early, served)

    async def _collect(
        self,
        episodes: Episodes,
        ready: list[int],
        changed: asyncio.Event,
        group: asyncio.TaskGroup,
    ) -> None:
        output = self.job.output("rollout")
        timeout = self.job.controller.config.item_timeout_s
        while episodes.num_done < episodes.num_samples:
            sample = await output.get(timeout=timeout)
            if sample.metadata.get("finish") == "error":
                raise BackendError(f"generation {sample.sample_id} failed: {sample.metadata}")
            self._turns += 1
            call = episodes.absorb(sample)
            if call is not None:
                group.create_task(self._call_tool(episodes, call))
            fresh = episodes.complete_groups()
            if fresh:
                ready.extend(fresh)
                self.job.set_remaining("trainer", episodes.num_groups - len(self._learned))
                changed.set()
            self._progress()

    async def _call_tool(self, episodes: Episodes, call: ToolCall) -> None:
        result = await self.tool.call(call.expression, call_id=call.call_id)
        request = episodes.tool_result(call, result.output)
        if request is not None:
            self.job.submit("rollout", [request])

    async def _learn(self, episodes: Episodes, ready: list[int], changed: asyncio.Event) -> None:
        """Learn complete micro-batches whenever the trainer holds devices."""
        total = episodes.num_groups
        while len(self._learned) < total:
            pending = [g for g in ready if g not in self._learned]
            devices = self.job.allocation.devices("trainer")
            if not pending or not devices:
                changed.clear()
                try:
                    async with asyncio.timeout(0.05):
                        await changed.wait()
                except TimeoutError:
                    pass
                continue
            # While the rollout runs, short calls let a move of the trainer start soon;
            # after it, nothing moves the trainer: one call learns everything pending.
            limit = len(pending) if self._final else len(devices) * self.chunk_micros
            chunk = pending[:limit]
            samples = [s for g in chunk for s in episodes.micro_batch(g)]
            began = time.perf_counter()
            extra = {"logprob_gap": True} if self.weights is not None else {}
            results = await self.job.call(
                "trainer", "learn", samples, num_samples=episodes.num_samples, **extra
            )
            per_rank = math.ceil(len(chunk) / max(1, len(results)))
            self._micro_s = (time.perf_counter() - began) / per_rank
            for result in results:
                done = str(result.values.get("computed", ""))
                self._learned.update(int(g) for g in done.split(",") if g)
                gap = result.values.get("logprob_gap")
                if isinstance(gap, float):
                    self._gap = max(gap, self._gap or 0.0)
            self.job.set_remaining("trainer", episodes.num_groups - len(self._learned))
            self._progress()

    async def _apply(self, episodes: Episodes) -> dict[str, MetaValue]:
        self._progress("step")
        results = await self.job.call(
            "trainer",
            "step",
            num_micros=episodes.num_groups,
            num_samples=episodes.num_samples,
        )
        first = _agreed(results, "checksum")
        version = first.values.get("version")
        self.version = int(version) if isinstance(version, int) else self.version + 1
        return dict(first.values)

    async def _sync(self, step: int) -> None:
        """Weights to every engine: local copies where the trainer lives, transfers
        planned by the migrate planner to engines elsewhere."""
        self._progress("sync")
        if self.weights is not None:
            await self.weights.push(self.job, self.version)
            return
        allocation = self.job.allocation
        trainer, rollout = allocation.devices("trainer"), allocation.devices("rollout")
        targets = ",".join(map(str, sorted(set(trainer) | set(rollout))))
        tag = f"s{step}-v{self.version}"
        calls = [self.job.call("trainer", "sync_weights", rollout=targets, tag=tag)]
        if rollout:
            calls.append(
                self.job.call(
                    "rollout",
                    "receive_weights",
                    trainer=",".join(map(str, trainer)),
                    rollout=targets,
                    tag=tag,
                    version=self.version,
                )
            )
        await asyncio.gather(*calls)

    def _record(
        self,
        step: int,
        episodes: Episodes,
        stats: Mapping[str, MetaValue],
        began: float,
        phases: dict[str, float],
        learned_early: int,
        served: int,
    ) -> StepReport:
        micros = [episodes.micro_batch(g) for g in range(episodes.num_groups)]
        order = [s for micro in micros for s in micro]
        self.trained.append(tuple(order))
        lengths = [_response_len(s) for s in order]
        rewards = tuple(float(s.reward or 0.0) for s in order)
        resumed = sum(int(s.metadata.get("resumed", 0) or 0) for s in order)
        record = StepReport(
            step=step,
            mean_reward=sum(rewards) / len(rewards),
            rewards=rewards,
            loss=meta_float(stats.get("loss")),
            kl=meta_float(stats.get("kl")),
            grad_norm=meta_float(stats.get("grad_norm")),
            version=self.version,
            checksum=str(stats.get("checksum", "")),
            manifest=tuple(s.sample_id for s in order),
            micro_sizes=tuple(len(m) for m in micros),
            wall_s=time.perf_counter() - began,
            rollout_s=phases["rollout"],
            learned_early=learned_early,
            resumed=resumed,
            turns=self._turns,
            mean_response_tokens=sum(lengths) / len(lengths),
            max_response_tokens=max(lengths),
            phases=phases,
            stale_tokens=sum(stale_tokens(s, served) for s in order),
            logprob_gap=self._gap,
        )
        logger.info(
            "%s step %d: reward %.3f loss %.4f in %.2f s (%d micro-batches learned early)",
            self.plan.label,
            step,
            record.mean_reward,
            record.loss,
            record.wall_s,
            learned_early,
        )
        return record


def _agreed(results: Sequence[CallResult], key: str) -> CallResult:
    if not results:
        raise BackendError("the trainer holds no device")
    values = {str(r.values.get(key)) for r in results}
    if len(values) != 1:
        raise BackendError(f"trainer ranks disagree on {key}: {sorted(values)}")
    return results[0]


def _response_len(sample: Sample) -> int:
    return len(sample.token_ids) // 4 - sample.prompt_len
