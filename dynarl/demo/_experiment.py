"""One reference GRPO job run under several device schedules, measured side by side.

:class:`ExperimentConfig` describes the job (task, model, steps, devices) and the
scheduler's iteration-scale thresholds for a CPU job; :func:`prepare_setup` writes the
initial weights every run starts from (a supervised warm start, cached by configuration);
:func:`run_plan` runs the job once on a fresh :class:`~dynarl.runtime.Job` under one
:class:`~._device_schedules.RunPlan` and returns a :class:`RunResult` — per-step reports (rewards,
losses, the manifest of sample ids and update order, trainer checksums), the allocation
over time, moves and migration pauses from the ledger; :func:`compare` sets runs side by
side. The device model: one worker process per device with one compute thread; every run
gets the same CPU, seed, prompts and initial weights. Runs on the caller's event loop
(``run_plan``) or thread (``prepare_setup``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dynarl.backends import GRPOConfig
from dynarl.backends.reference import (
    EngineConfig,
    GPTConfig,
    ReferenceSetup,
    ToolLatency,
    default_train,
    save_weights_file,
    warm_start,
)
from dynarl.bus import DecisionRecord, MigrationRecord, Sample
from dynarl.demo._device_schedules import (
    DriverProgress,
    RunPlan,
    Schedule,
    StepReport,
    reference_components,
)
from dynarl.demo._driver import EngineWeights, GRPODriver
from dynarl.runtime import ComponentSpec, ForeignLoad, Job, JobConfig, LoadMeter, RuntimeConfig
from dynarl.sched import ComponentProfile, ProfilePoint, SchedulerConfig

__all__ = [
    "Comparison",
    "ExperimentConfig",
    "Observer",
    "RunResult",
    "compare",
    "plans",
    "prepare_setup",
    "profiles_from",
    "run_plan",
]

logger = logging.getLogger(__name__)

_SAMPLE_S = 0.05
"""Period of the allocation timeline's samples, seconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExperimentConfig:
    """The reference job every schedule runs, and how dynarl's scheduler is tuned for it."""

    num_devices: int = 2
    """Devices (worker processes) of the job."""
    num_steps: int = 5
    """GRPO steps per run."""
    num_prompts: int = 32
    """Prompts per step (one micro-batch each)."""
    seed: int = 0
    """Seeds the model, the problems and sampling: the same in every run."""
    task: str = "tool_calc"
    """``tool_calc`` (multi-turn with the calculator) or ``chain_sum`` (single turn)."""
    group_size: int = 16
    """Episodes per prompt."""
    hidden_size: int = 128
    """Width of the model."""
    num_layers: int = 2
    """Transformer blocks."""
    max_response_tokens: int = 120
    """Token budget of one episode's response (tool results included)."""
    max_products: int = 3
    """tool_calc: most products per prompt (2k - 1 calculator calls for k products)."""
    max_operand: int = 9
    """tool_calc: largest operand."""
    tool_median_s: float = 0.15
    """Median calculator latency, seconds (environment time, the same in every run)."""
    tool_sigma: float = 1.0
    """Log-space spread of the calculator latency: most calls are quick, a few take up
    to ``tool_max_s``, so a step's last episodes wait on slow calls while the engines
    idle — the rollout's tail."""
    tool_max_s: float = 4.0
    """Longest calculator call, seconds (the latency distribution's cap)."""
    lr: float = 1e-4
    """RL learning rate."""
    kl_coef: float = 0.01
    """Weight of the KL penalty to the initial policy (the trainer scores every sample
    under the reference weights)."""
    sft_steps: int = 200
    """Supervised warm-start steps before RL."""
    deterministic: bool = True
    """Batch-invariant decoding (bitwise-comparable runs; the trainer always sums its
    gradient rows in micro-batch order)."""
    util_low: float = 0.02
    """U_low of the scheduler for this job (KV utilization under which an engine idles):
    0.02 of the 4096-token KV capacity is about two running episodes; in the bulk of a
    rollout an engine holds 0.1-0.3."""
    donor_window_s: float = 0.4
    """T of the scheduler for this job: seconds an engine idles before it counts."""
    min_move_interval_s: float = 1.0
    """Least time between two of the scheduler's moves, seconds."""
    resume_where_left: bool = False
    """dynarl: a rollout starts where the scheduler left the trainer at the end of the
    last one, the first where the trainer was created, on its home device (False, the
    default: every rollout starts on every device — its bulk is compute-bound — and the
    scheduler gives the trainer a device when the tail leaves an engine idle)."""
    move_cost_s: float = 0.2
    """dynarl: seconds one trainer reshard (a P2P grow or shrink) is assumed to cost until
    the driver has measured one; it grows the trainer at the barrier only when that saves
    more learning time than a grow and a shrink cost."""
    always_grow: bool = False
    """dynarl: grow the trainer onto every device at each barrier whatever it costs
    (exercises the P2P reshards; tests)."""

    def __post_init__(self) -> None:
        if self.num_devices < 2:
            raise ValueError(f"ExperimentConfig.num_devices must be >= 2, got {self.num_devices}")
        for name in ("num_steps", "num_prompts", "group_size", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"ExperimentConfig.{name} must be >= 1")
        if self.sft_steps < 0 or self.tool_median_s < 0 or self.tool_sigma < 0:
            raise ValueError("ExperimentConfig: sft_steps and tool latency must be >= 0")
        if self.tool_max_s < self.tool_median_s:
            raise ValueError("ExperimentConfig.tool_max_s must be >= tool_median_s")
        if self.move_cost_s < 0:
            raise ValueError(f"ExperimentConfig.move_cost_s must be >= 0, got {self.move_cost_s}")

    def setup(self) -> ReferenceSetup:
        """The job's :class:`ReferenceSetup` (without initial weights)."""
        model = GPTConfig(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            ffn_hidden_size=4 * self.hidden_size,
            seed=self.seed,
        )
        return ReferenceSetup(
            model=model,
            train=default_train(lr=self.lr, grpo=GRPOConfig(kl_coef=self.kl_coef)),
            engine=EngineConfig(deterministic=self.deterministic),
            task=self.task,
            max_products=self.max_products,
            max_operand=self.max_operand,
            group_size=self.group_size,
            max_response_tokens=self.max_response_tokens,
            seed=self.seed,
            tool_latency=ToolLatency(
                median_s=self.tool_median_s, sigma=self.tool_sigma, max_s=self.tool_max_s
            ),
        )

    def runtime(self) -> RuntimeConfig:
        """The runtime and scheduler settings of a CPU job whose iterations last seconds.

        The DynaRL paper's defaults (T = 4 s, 10 s between moves) are for iterations of minutes;
        here T, the move interval and the report periods are scaled to the job, one idle
        engine of two makes rollout a donor (θ = 0.5), and the prediction-error guard is
        relaxed because a rollout's throughput swings with its tail within seconds.
        """
        return RuntimeConfig(
            metrics_interval_s=0.2,
            report_interval_s=0.25,
            scheduler=SchedulerConfig(
                donor_fraction=0.5,
                util_low=self.util_low,
                donor_window_s=self.donor_window_s,
                stats_window_s=max(5.0, self.donor_window_s),
                min_move_interval_s=self.min_move_interval_s,
                decision_interval_s=0.25,
                max_prediction_error=10.0,
            ),
        )

    def key(self) -> str:
        """Digest of what the initial weights depend on (the warm-start cache key)."""
        setup = self.setup()
        text = json.dumps(
            [
                repr(setup.model),
                setup.task,
                self.sft_steps,
                self.seed,
                setup.max_response_tokens,
                self.max_products,
                self.max_operand,
            ]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare_setup(config: ExperimentConfig, cache_dir: str | Path) -> ReferenceSetup:
    """The setup with its initial weights: read from ``cache_dir`` when a warm start of
    the same configuration is there, else computed here (this thread, one rank) and
    written there. Raises ValueError if torch.distributed is initialized here."""
    setup = config.setup()
    path = Path(cache_dir) / f"init-{config.key()}.pt"
    if not path.exists():
        began = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one compute thread, as on the job's devices
        try:
            weights = warm_start(setup, num_steps=config.sft_steps, lr=3e-3)
        finally:
            torch.set_num_threads(threads)
        tmp = path.with_suffix(".tmp")
        save_weights_file(tmp, weights)
        tmp.replace(path)
        logger.info("warm start: %d steps in %.1f s", config.sft_steps, time.perf_counter() - began)
    return replace(setup, init_path=str(path))


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """One run of the job under one schedule."""

    label: str
    """``dynarl``, ``sequential`` or ``split-k/m``."""
    plan: RunPlan
    """The schedule."""
    steps: tuple[StepReport, ...]
    """Per-step reports."""
    wall_s: float
    """Seconds from the first step's start to the last step's end."""
    timeline: tuple[tuple[float, dict[str, int]], ...]
    """(seconds since the first step, devices per component) at every change."""
    step_starts: tuple[float, ...]
    """Seconds since the first step at which each step began."""
    scheduler_moves: int
    """Moves the scheduler decided and committed."""
    migrations: int
    """Committed migrations of any component (the schedule's own role switches too)."""
    pause_s: float
    """Total migration pause, seconds."""
    reshards_verified: int
    """Trainer reshards whose state checksum was equal before and after."""
    run_dir: str
    """Where its ledger and worker logs are."""
    load: ForeignLoad | None = None
    """The machine's CPU over the run, this job's and other processes' (None: not
    measured)."""
    trained: tuple[tuple[Sample, ...], ...] = ()
    """Per step, the samples the trainer learned, in update order (for a replay)."""

    @property
    def manifests(self) -> tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]:
        """Per step: sample ids in update order and micro-batch sizes."""
        return tuple((s.manifest, s.micro_sizes) for s in self.steps)

    def manifest_digest(self) -> str:
        """SHA-256 of every step's manifest (ids, update order, composition)."""
        return hashlib.sha256(repr(self.manifests).encode()).hexdigest()


Observer = Callable[[str, DriverProgress], None]


async def run_plan(
    setup: ReferenceSetup,
    plan: RunPlan,
    config: ExperimentConfig,
    *,
    run_dir: str | Path,
    profiles: dict[str, ComponentProfile] | None = None,
    observer: Observer | None = None,
    components: Sequence[ComponentSpec] | None = None,
    weights: EngineWeights | None = None,
    runtime: RuntimeConfig | None = None,
) -> RunResult:
    """Run ``config.num_steps`` GRPO steps under ``plan`` on a fresh job in ``run_dir``.

    The reference job's components by default; ``components`` (placed for ``plan``),
    ``weights`` and ``runtime`` run the same loop on others — real engines and the Megatron
    trainer (:mod:`~dynarl.demo._engine_demo`). Raises BackendError (a failed move, call
    or sample) and the job's start-up errors.
    """
    run_dir = Path(run_dir)
    label = plan.label
    if components is None:
        components = reference_components(setup, plan, profiles=profiles)
    job_config = JobConfig(
        num_devices=plan.num_devices,
        run_dir=str(run_dir),
        runtime=runtime if runtime is not None else config.runtime(),
    )
    async with Job(components, job_config) as job:

        def forward(progress: DriverProgress) -> None:
            if observer is not None:
                observer(label, progress)

        driver = GRPODriver(
            job,
            setup,
            plan,
            num_prompts=config.num_prompts,
            observer=forward,
            resume_where_left=config.resume_where_left,
            move_cost_s=config.move_cost_s,
            always_grow=config.always_grow,
            weights=weights,
        )
        await driver.prepare()
        clock = job.scheduler.clock
        origin = clock.now()
        meter = LoadMeter()
        timeline: list[tuple[float, dict[str, int]]] = []
        starts: list[float] = []
        reports: list[StepReport] = []
        async with asyncio.TaskGroup() as group:
            sampler = group.create_task(_sample_allocation(job, origin, timeline))
            try:
                for step in range(config.num_steps):
                    starts.append(clock.now() - origin)
                    reports.append(await driver.train_step(step))
            finally:
                sampler.cancel()
        wall = clock.now() - origin
        load = meter.read()
        moves, migrations, pause = _ledger_figures(job, origin)
    return RunResult(
        label=label,
        plan=plan,
        steps=tuple(reports),
        wall_s=wall,
        timeline=tuple(timeline),
        step_starts=tuple(starts),
        scheduler_moves=moves,
        migrations=migrations,
        pause_s=pause,
        reshards_verified=driver.reshards_verified,
        run_dir=str(run_dir),
        load=load,
        trained=tuple(driver.trained),
    )


async def _sample_allocation(
    job: Job, origin: float, timeline: list[tuple[float, dict[str, int]]]
) -> None:
    """Record the allocation whenever it changed (polled), until cancelled."""
    last: dict[str, int] | None = None
    while True:
        counts = {name: len(devs) for name, devs in job.allocation.as_dict().items()}
        if counts != last:
            timeline.append((max(0.0, job.scheduler.clock.now() - origin), counts))
            last = counts
        await asyncio.sleep(_SAMPLE_S)


def _ledger_figures(job: Job, origin: float) -> tuple[int, int, float]:
    moves = migrations = 0
    pause = 0.0
    for record in job.ledger:
        if record.time < origin:
            continue
        if isinstance(record, DecisionRecord) and record.committed:
            moves += 1
        elif isinstance(record, MigrationRecord) and record.outcome == "committed":
            migrations += 1
            pause += record.pause_s
    return moves, migrations, pause


def profiles_from(result: RunResult, config: ExperimentConfig) -> dict[str, ComponentProfile]:
    """Offline profiles for the scheduler's predictor from a run of the job (the
    sequential one): generation turns per second of one rollout device, micro-batches
    per second of one trainer device."""
    steps = result.steps
    devices = result.plan.num_devices
    rollout_s = sum(s.rollout_s for s in steps)
    learn_s = sum(s.phases.get("learn", 0.0) for s in steps)
    turns = sum(s.turns for s in steps)
    micros = sum(len(s.micro_sizes) for s in steps)
    out: dict[str, ComponentProfile] = {}
    if rollout_s > 0 and turns:
        out["rollout"] = ComponentProfile(
            points=(ProfilePoint(num_devices=devices, throughput=turns / rollout_s),),
            items_per_device=float(config.group_size * 4),
        )
    if learn_s > 0 and micros:
        out["trainer"] = ComponentProfile(
            points=(ProfilePoint(num_devices=devices, throughput=micros / learn_s),),
        )
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """dynarl against the static schedules."""

    dynarl: RunResult
    """The dynarl run."""
    sequential: RunResult
    """Static sequential."""
    splits: tuple[RunResult, ...]
    """Every static split of the sweep."""
    best_split: RunResult
    """The fastest split."""
    manifests_equal: bool
    """Every run's per-step manifests identical."""
    checksums_equal: bool
    """Every run's per-step trainer checksums identical (deterministic mode: bitwise)."""
    rewards_equal: bool
    """Every run's per-step rewards identical."""
    speedup_vs_sequential: float = field(default=0.0)
    """Sequential wall time over dynarl's."""
    speedup_vs_best_split: float = field(default=0.0)
    """Best split's wall time over dynarl's."""

    @property
    def loaded_runs(self) -> tuple[RunResult, ...]:
        """The runs that ran under foreign load (other processes took
        :data:`~dynarl.runtime.FOREIGN_LOAD_LIMIT` cores or more on average)."""
        runs = (self.dynarl, self.sequential, *self.splits)
        return tuple(r for r in runs if r.load is not None and r.load.loaded)


def compare(dynarl: RunResult, sequential: RunResult, splits: Sequence[RunResult]) -> Comparison:
    """Set the runs side by side. Raises ValueError without a split."""
    if not splits:
        raise ValueError("compare needs at least one static split")
    runs = [dynarl, sequential, *splits]
    best = min(splits, key=lambda r: r.wall_s)
    return Comparison(
        dynarl=dynarl,
        sequential=sequential,
        splits=tuple(splits),
        best_split=best,
        manifests_equal=len({r.manifest_digest() for r in runs}) == 1,
        checksums_equal=len({tuple(s.checksum for s in r.steps) for r in runs}) == 1,
        rewards_equal=len({tuple(s.rewards for s in r.steps) for r in runs}) == 1,
        speedup_vs_sequential=sequential.wall_s / dynarl.wall_s,
        speedup_vs_best_split=best.wall_s / dynarl.wall_s,
    )


def plans(config: ExperimentConfig) -> tuple[RunPlan, RunPlan, tuple[RunPlan, ...]]:
    """dynarl, static sequential, and every static split of the devices."""
    n = config.num_devices
    splits = tuple(
        RunPlan(schedule=Schedule.SPLIT, num_devices=n, num_rollout_devices=k) for k in range(1, n)
    )
    return (
        RunPlan(schedule=Schedule.DYNARL, num_devices=n),
        RunPlan(schedule=Schedule.SEQUENTIAL, num_devices=n),
        splits,
    )
