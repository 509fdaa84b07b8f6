"""The reference CPU backend: a real, small RL stack that runs anywhere torch runs.

* model: :class:`ParallelGPT` (Megatron-core tensor-parallel layers, gloo on CPU);
* rollout: :class:`RolloutEngine` (continuous batching, per-sequence KV cache, prefix
  cache, injected request queue, abort with partial output, KV utilization, sampling keyed
  by seed, sample id and position, a batch-invariant deterministic mode);
* inference and tools: :class:`LogProbWorker`, :class:`ToolWorker` (a calculator);
* training: :class:`Trainer` (TP × DP, ``torch.optim.Adam``, DP-size-invariant
  deterministic mode) and GRPO's math (:func:`group_advantages`, :func:`policy_loss`);
* tasks: :class:`ChainSumTask` (heavy-tailed single turn), :class:`ToolCalcTask`
  (multi-turn with the calculator), :class:`CharTokenizer`;
* :func:`run_grpo`: the whole job in one process;
* runtime roles: :class:`ReferenceRollout`, :class:`ReferenceInference`,
  :class:`ReferenceTools`, :class:`ReferenceTrainer` (streamed GRPO steps, P2P
  resharding, weight sync planned by ``dynarl.migrate``), configured by one
  :class:`ReferenceSetup`; :class:`GRPODriver` runs GRPO on a ``dynarl.Job`` under a
  :class:`Schedule` (dynarl, static sequential, static split);
* asynchronous GRPO with hybrid replicas (seed 004): :class:`AsyncGRPODriver` (a
  bounded :class:`MessageQueue` with a per-token staleness gate between rollout and
  trainer; trainer devices serve as hybrid rollout replicas through :class:`JobReplicas`
  under ``dynarl.sched.HybridController``), :func:`run_async` (:class:`AsyncConfig`,
  :class:`AsyncRunResult`) — what ``dynarl demo --mode hybrid`` runs;
  :func:`compare_curves` tests that two non-bitwise runs' curves agree within noise;
* experiments: :func:`run_plan` runs the job once under a :class:`RunPlan` on a fresh
  ``dynarl.Job``, :func:`compare` sets dynarl against the static schedules
  (:class:`ExperimentConfig`, :class:`RunResult`, :class:`Comparison`) — what
  ``dynarl demo`` and ``bench/e2e.py`` run.

Importing this package imports Megatron-core (after applying the CPU shim).
"""

from __future__ import annotations

from dynarl.backends.reference.accumulate import GradientBook
from dynarl.backends.reference.async_driver import AsyncGRPODriver
from dynarl.backends.reference.async_records import AsyncConfig, AsyncRunResult, AsyncStepReport
from dynarl.backends.reference.decoder import Decoder, DecoderRows
from dynarl.backends.reference.driver import GRPODriver
from dynarl.backends.reference.engine import EngineConfig, RolloutEngine
from dynarl.backends.reference.episodes import Episodes, ToolCall
from dynarl.backends.reference.experiment import (
    Comparison,
    ExperimentConfig,
    RunResult,
    compare,
    plans,
    prepare_setup,
    profiles_from,
    run_plan,
)
from dynarl.backends.reference.grpo import (
    GRPOConfig,
    PolicyLoss,
    TrainSample,
    group_advantages,
    kl_k3,
    pad_samples,
    per_target,
    policy_loss,
)
from dynarl.backends.reference.hybrid_job import async_components, run_async
from dynarl.backends.reference.hybrid_replicas import JobReplicas
from dynarl.backends.reference.kvcache import KVPool, KVPoolShape
from dynarl.backends.reference.learner import ReferenceTrainer
from dynarl.backends.reference.logprob import LogProbWorker
from dynarl.backends.reference.model import (
    GPTConfig,
    ParallelGPT,
    ParamShard,
    check_full_state,
    local_world,
    param_layout,
    solo_process_group,
)
from dynarl.backends.reference.plan import (
    DriverProgress,
    RunPlan,
    Schedule,
    StepReport,
    reference_components,
)
from dynarl.backends.reference.prefix_cache import PrefixCache, PrefixMatch
from dynarl.backends.reference.request import (
    EngineStats,
    FifoQueue,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    PendingRequest,
    RequestQueue,
)
from dynarl.backends.reference.rollout import RolloutConfig, Sample, collect_rollouts
from dynarl.backends.reference.sampling import sample_tokens, sampling_uniform
from dynarl.backends.reference.serving import (
    PriorityRequestQueue,
    ReferenceInference,
    ReferenceRollout,
    ReferenceTools,
)
from dynarl.backends.reference.setup import (
    ReferenceSetup,
    load_weights_file,
    save_weights_file,
    warm_start,
)
from dynarl.backends.reference.smoke import (
    SmokeConfig,
    SmokeResult,
    StepRecord,
    make_task,
    run_grpo,
    sft_samples,
)
from dynarl.backends.reference.staleness import (
    MessageQueue,
    StalenessStats,
    group_admissible,
    sample_staleness,
    token_versions,
)
from dynarl.backends.reference.tasks import (
    ChainSumTask,
    Problem,
    Task,
    ToolCalcTask,
    environment_mask,
)
from dynarl.backends.reference.tokenizer import CharTokenizer
from dynarl.backends.reference.tolerance import CurveComparison, compare_curves, group_means
from dynarl.backends.reference.tools import Calculator, ToolLatency, ToolResult, ToolWorker
from dynarl.backends.reference.trainer import (
    StepStats,
    TrainConfig,
    Trainer,
    TrainerState,
    state_checksum,
)
from dynarl.backends.reference.weights import (
    param_specs,
    sync_plan,
    trainer_state_layout,
)

__all__ = [
    "AsyncConfig",
    "AsyncGRPODriver",
    "AsyncRunResult",
    "AsyncStepReport",
    "Calculator",
    "ChainSumTask",
    "CharTokenizer",
    "Comparison",
    "CurveComparison",
    "Decoder",
    "DecoderRows",
    "DriverProgress",
    "EngineConfig",
    "EngineStats",
    "Episodes",
    "ExperimentConfig",
    "FifoQueue",
    "FinishReason",
    "GPTConfig",
    "GRPOConfig",
    "GRPODriver",
    "GenerationOutput",
    "GenerationRequest",
    "GradientBook",
    "JobReplicas",
    "KVPool",
    "KVPoolShape",
    "LogProbWorker",
    "MessageQueue",
    "ParallelGPT",
    "ParamShard",
    "PendingRequest",
    "PolicyLoss",
    "PrefixCache",
    "PrefixMatch",
    "PriorityRequestQueue",
    "Problem",
    "ReferenceInference",
    "ReferenceRollout",
    "ReferenceSetup",
    "ReferenceTools",
    "ReferenceTrainer",
    "RequestQueue",
    "RolloutConfig",
    "RolloutEngine",
    "RunPlan",
    "RunResult",
    "Sample",
    "Schedule",
    "SmokeConfig",
    "SmokeResult",
    "StalenessStats",
    "StepRecord",
    "StepReport",
    "StepStats",
    "Task",
    "ToolCalcTask",
    "ToolCall",
    "ToolLatency",
    "ToolResult",
    "ToolWorker",
    "TrainConfig",
    "TrainSample",
    "Trainer",
    "TrainerState",
    "async_components",
    "check_full_state",
    "collect_rollouts",
    "compare",
    "compare_curves",
    "environment_mask",
    "group_admissible",
    "group_advantages",
    "group_means",
    "kl_k3",
    "load_weights_file",
    "local_world",
    "make_task",
    "pad_samples",
    "param_layout",
    "param_specs",
    "per_target",
    "plans",
    "policy_loss",
    "prepare_setup",
    "profiles_from",
    "reference_components",
    "run_async",
    "run_grpo",
    "run_plan",
    "sample_staleness",
    "sample_tokens",
    "sampling_uniform",
    "save_weights_file",
    "sft_samples",
    "solo_process_group",
    "state_checksum",
    "sync_plan",
    "token_versions",
    "trainer_state_layout",
    "warm_start",
]
