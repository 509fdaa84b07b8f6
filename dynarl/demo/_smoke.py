"""A whole GRPO job in one process: the path the runtime later spreads across processes.

:func:`run_grpo` builds the trainer (Megatron's, the reference architecture as a GPTModel),
a rollout engine, a log-prob worker (the reference
policy, for the KL term) and a tool worker, warms the policy up with a few supervised
steps on the task's reference responses (RL post-training starts from an SFT model; from
random weights no response earns a reward and every advantage is zero), then for each
step: generate ``group_size`` episodes per problem, score them with the exact checker,
compute group-relative advantages, take one optimizer step, and sync the new weights
into the engine. It returns one :class:`StepRecord` per step — reward, loss, lengths,
phase times, the sample manifest and the trainer checksum.

Runs on the calling thread (its own asyncio loop for the rollout). In deterministic mode
it sets torch to one intra-op thread for its duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from dynarl.backends import GRPOConfig, TrainSample, group_advantages
from dynarl.backends.megatron import MegatronTrainConfig, MegatronTrainer
from dynarl.backends.reference import (
    ChainSumTask,
    CharTokenizer,
    EngineConfig,
    GPTConfig,
    LogProbWorker,
    RolloutConfig,
    RolloutEngine,
    Sample,
    Task,
    ToolCalcTask,
    ToolLatency,
    ToolWorker,
    collect_rollouts,
    default_train,
    from_megatron,
    megatron_model,
    sft_samples,
    solo_process_group,
)

__all__ = ["SmokeConfig", "SmokeResult", "StepRecord", "make_task", "run_grpo", "sft_samples"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SmokeConfig:
    """A small GRPO job."""

    task: str = "chain_sum"
    """``"chain_sum"`` (single turn) or ``"tool_calc"`` (multi-turn with the calculator)."""
    num_steps: int = 12
    """GRPO steps."""
    num_prompts: int = 16
    """Problems per step."""
    dataset_size: int = 16
    """0: fresh problems every step; n: a fixed training set of n problems, cycled."""
    sft_steps: int = 50
    """Supervised warm-up steps before RL."""
    sft_batch_size: int = 32
    """Reference responses per warm-up step."""
    sft_lr: float = 2e-3
    """Learning rate of the warm-up (RL uses ``train.lr``)."""
    num_minibatches: int = 4
    """Optimizer steps per GRPO step: the rollout batch is split into this many
    mini-batches, each step's ratio taken against the log-probs before the first."""
    seed: int = 0
    """Seeds the model, the problems and sampling."""
    deterministic: bool = True
    """Batch-invariant decoding and DP-invariant gradient sums."""
    model: GPTConfig = field(default_factory=GPTConfig)
    """Architecture."""
    train: MegatronTrainConfig = field(
        default_factory=lambda: default_train(grpo=GRPOConfig(kl_coef=0.01))
    )
    """Optimizer and loss."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Rollout engine capacity."""
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(group_size=16))
    """Episode settings."""
    tool_latency: ToolLatency = field(default_factory=lambda: ToolLatency(median_s=0.0))
    """Calculator latency."""

    def __post_init__(self) -> None:
        if self.task not in ("chain_sum", "tool_calc"):
            raise ValueError(f"SmokeConfig.task must be chain_sum or tool_calc, got {self.task!r}")
        for name in ("num_prompts", "sft_batch_size", "num_minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"SmokeConfig.{name} must be >= 1")
        if self.sft_lr <= 0:
            raise ValueError(f"SmokeConfig.sft_lr must be > 0, got {self.sft_lr}")
        if self.sft_steps < 0 or self.num_steps < 0:
            raise ValueError("SmokeConfig.sft_steps and num_steps must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """What one GRPO step did."""

    step: int
    """Step index (0-based)."""
    mean_reward: float
    """Mean reward of the step's samples."""
    loss: float
    """Training loss."""
    kl: float
    """KL to the reference policy."""
    grad_norm: float
    """Gradient norm."""
    mean_response_tokens: float
    """Mean response length, tokens."""
    max_response_tokens: int
    """Longest response, tokens."""
    tool_calls: int
    """Tool calls made by the step's episodes."""
    manifest: tuple[int, ...]
    """Sample ids in the order they entered the update."""
    rewards: tuple[float, ...]
    """Reward per sample, in manifest order."""
    checksum: str
    """Trainer state checksum after the step."""
    rollout_s: float
    """Seconds generating (tools included)."""
    logprob_s: float
    """Seconds computing reference log-probs."""
    train_s: float
    """Seconds in the optimizer step."""
    sync_s: float
    """Seconds syncing weights into the engine."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SmokeResult:
    """A finished job."""

    records: tuple[StepRecord, ...]
    """One per GRPO step."""
    sft_losses: tuple[float, ...]
    """Loss of each warm-up step."""
    generated_tokens: int
    """Tokens the engine sampled over the job."""
    prefix_hit_tokens: int
    """Prompt tokens the prefix cache served over the job."""


def make_task(name: str, *, seed: int, dataset_size: int = 0) -> Task:
    """The task called ``name`` (``chain_sum`` or ``tool_calc``); ValueError otherwise."""
    if name == "chain_sum":
        return ChainSumTask(seed=seed, dataset_size=dataset_size)
    if name == "tool_calc":
        return ToolCalcTask(seed=seed, dataset_size=dataset_size)
    raise ValueError(f"unknown task {name!r}")


@contextlib.contextmanager
def _threads(deterministic: bool) -> Iterator[None]:
    before = torch.get_num_threads()
    if deterministic:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_grpo(config: SmokeConfig) -> SmokeResult:
    """Run the job in this process (a one-rank gloo group is created and destroyed).

    Raises ValueError if torch.distributed is already initialized here.
    """
    with _threads(config.deterministic), solo_process_group() as group:
        job = _Job(config, group)
        try:
            return job.run()
        finally:
            job.trainer.close()


class _Job:
    def __init__(self, config: SmokeConfig, group: torch.distributed.ProcessGroup) -> None:
        self.config = config
        self.tokenizer = CharTokenizer()
        if config.model.vocab_size != self.tokenizer.vocab_size:
            raise ValueError("SmokeConfig.model.vocab_size must match the tokenizer's")
        self.task = make_task(config.task, seed=config.seed, dataset_size=config.dataset_size)
        # Warm-up problems come from another seed: never the RL training set itself.
        self.sft_task = make_task(config.task, seed=config.seed + 1)
        train = config.train
        self.trainer = MegatronTrainer(
            megatron_model(config.model),
            train,
            rank=0,
            store=dist.HashStore(),  # type: ignore[attr-defined]
        )
        self.trainer.start(self.trainer.layout_spec((0,)), epoch=0)
        engine_config = config.engine
        if engine_config.deterministic != config.deterministic:
            engine_config = replace(engine_config, deterministic=config.deterministic)
        self.engine = RolloutEngine(config.model, engine_config)
        self.reference = LogProbWorker(config.model, tp_group=group, temperature=train.temperature)
        self.policy = LogProbWorker(config.model, tp_group=group, temperature=train.temperature)
        self.tool = ToolWorker(latency=config.tool_latency, seed=config.seed)

    def run(self) -> SmokeResult:
        cfg = self.config
        self.trainer.set_lr(cfg.sft_lr)
        sft_losses = tuple(
            self.trainer.sft_step(
                sft_samples(
                    self.task, self.tokenizer, step=10_000 + i, batch_size=cfg.sft_batch_size
                )
            ).loss
            for i in range(cfg.sft_steps)
        )
        self.trainer.set_lr(cfg.train.lr)
        weights = self._weights()
        self.reference.load_weights(weights, self.trainer.version)
        self.policy.load_weights(weights, self.trainer.version)
        self.engine.load_weights(weights, self.trainer.version)
        records = tuple(self._step(step) for step in range(cfg.num_steps))
        stats = self.engine.stats()
        return SmokeResult(
            records=records,
            sft_losses=sft_losses,
            generated_tokens=stats.generated_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
        )

    def _step(self, step: int) -> StepRecord:
        cfg = self.config
        t0 = time.perf_counter()
        problems = self.task.problems(step=step, num_problems=cfg.num_prompts)
        rollout = replace(cfg.rollout, seed=cfg.seed)
        samples = asyncio.run(
            collect_rollouts(
                self.engine, self.task, self.tokenizer, problems, rollout, tool=self.tool
            )
        )
        t1 = time.perf_counter()
        sequences = [s.tokens for s in samples]
        ref = self.reference.compute(sequences) if cfg.train.grpo.kl_coef > 0 else None
        old = self.policy.compute(sequences)
        t2 = time.perf_counter()
        batch = self._batch(samples, old, ref)
        size = -(-len(batch) // cfg.num_minibatches)
        all_stats = [
            self.trainer.train_step(batch[i : i + size]) for i in range(0, len(batch), size)
        ]
        stats = all_stats[-1]
        t3 = time.perf_counter()
        weights = self._weights()
        self.engine.load_weights(weights, self.trainer.version)
        self.policy.load_weights(weights, self.trainer.version)
        t4 = time.perf_counter()
        lengths = [len(s.response_tokens) for s in samples]
        rewards = tuple(s.reward for s in samples)
        logger.info("step %d: reward %.3f loss %.4f", step, sum(rewards) / len(rewards), stats.loss)
        return StepRecord(
            step=step,
            mean_reward=sum(rewards) / len(rewards),
            loss=sum(st.loss for st in all_stats) / len(all_stats),
            kl=stats.kl,
            grad_norm=stats.grad_norm,
            mean_response_tokens=sum(lengths) / len(lengths),
            max_response_tokens=max(lengths),
            tool_calls=sum(s.num_tool_calls for s in samples),
            manifest=tuple(s.sample_id for s in samples),
            rewards=rewards,
            checksum=self.trainer.state_checksum(),
            rollout_s=t1 - t0,
            logprob_s=t2 - t1,
            train_s=t3 - t2,
            sync_s=t4 - t3,
        )

    def _weights(self) -> dict[str, torch.Tensor]:
        """The trainer's parameters under the reference names (engine and scorers)."""
        return from_megatron(self.trainer.gather(0), self.config.model)

    def _batch(
        self,
        samples: Sequence[Sample],
        old: list[tuple[float, ...]],
        ref: list[tuple[float, ...]] | None,
    ) -> list[TrainSample]:
        group = self.config.rollout.group_size
        rewards = torch.tensor([s.reward for s in samples]).view(-1, group)
        grpo = self.config.train.grpo
        advantages = group_advantages(rewards, normalize_std=grpo.normalize_std, eps=grpo.adv_eps)
        return [
            sample.train_sample(
                float(adv), old_logprobs=old[i], ref_logprobs=None if ref is None else ref[i]
            )
            for i, (sample, adv) in enumerate(zip(samples, advantages.view(-1), strict=True))
        ]
