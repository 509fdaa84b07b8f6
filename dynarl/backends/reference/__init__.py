"""The reference CPU backend: a real, small RL stack that runs anywhere torch runs.

* model: :class:`GPTConfig`, :class:`ParallelGPT` (Megatron-core tensor-parallel layers,
  gloo on CPU);
* rollout: :class:`RolloutEngine` (:class:`EngineConfig`; continuous batching,
  per-sequence KV cache, prefix cache, injected request queue, abort with partial output,
  KV utilization, sampling keyed by seed, sample id and position, a batch-invariant
  deterministic mode), driven episode by episode by :func:`collect_rollouts`;
* inference and tools: :class:`LogProbWorker`, :class:`ToolWorker` (a calculator behind
  a :class:`ToolLatency`);
* training: :class:`Trainer` (:class:`TrainConfig`; TP × DP, ``torch.optim.Adam``,
  DP-size-invariant deterministic mode) on GRPO's math from :mod:`dynarl.backends`;
* tasks: :class:`ChainSumTask` (heavy-tailed single turn), :class:`ToolCalcTask`
  (multi-turn with the calculator), :class:`CharTokenizer`, :func:`sft_samples`;
* runtime roles: :class:`ReferenceRollout`, :class:`ReferenceInference`,
  :class:`ReferenceTools`, :class:`ReferenceTrainer` (streamed GRPO steps, P2P
  resharding, weight sync planned by ``dynarl.migrate``), configured by one
  :class:`ReferenceSetup` (:func:`warm_start` gives it supervised initial weights);
* asynchronous GRPO's pieces: a bounded :class:`MessageQueue` with a per-token staleness
  gate, and :class:`JobReplicas`, the trainer's devices as hybrid rollout replicas.

The experiments built from these — the GRPO drivers, device schedules and ``dynarl demo``
— are the main job, in :mod:`dynarl.demo`. Importing this package imports Megatron-core
(after applying the CPU shim).
"""

from __future__ import annotations

from dynarl.backends._grpo import GRPOConfig
from dynarl.backends.reference._episode_loop import RolloutConfig, Sample, collect_rollouts
from dynarl.backends.reference._episodes import Episodes, ToolCall
from dynarl.backends.reference._gpt import GPTConfig, ParallelGPT, solo_process_group
from dynarl.backends.reference._hybrid_replicas import JobReplicas
from dynarl.backends.reference._learner import ReferenceTrainer
from dynarl.backends.reference._logprob import LogProbWorker
from dynarl.backends.reference._rollout_engine import EngineConfig, RolloutEngine
from dynarl.backends.reference._samples import GROUP, SEED_ID, meta_float
from dynarl.backends.reference._serving import ReferenceInference, ReferenceRollout, ReferenceTools
from dynarl.backends.reference._setup import ReferenceSetup, save_weights_file, warm_start
from dynarl.backends.reference._staleness import MessageQueue
from dynarl.backends.reference._tasks import ChainSumTask, Problem, Task, ToolCalcTask, sft_samples
from dynarl.backends.reference._tokenizer import CharTokenizer
from dynarl.backends.reference._tools import ToolLatency, ToolWorker
from dynarl.backends.reference._trainer import TrainConfig, Trainer

__all__ = [
    "GROUP",
    "SEED_ID",
    "ChainSumTask",
    "CharTokenizer",
    "EngineConfig",
    "Episodes",
    "GPTConfig",
    "GRPOConfig",
    "JobReplicas",
    "LogProbWorker",
    "MessageQueue",
    "ParallelGPT",
    "Problem",
    "ReferenceInference",
    "ReferenceRollout",
    "ReferenceSetup",
    "ReferenceTools",
    "ReferenceTrainer",
    "RolloutConfig",
    "RolloutEngine",
    "Sample",
    "Task",
    "ToolCalcTask",
    "ToolCall",
    "ToolLatency",
    "ToolWorker",
    "TrainConfig",
    "Trainer",
    "collect_rollouts",
    "meta_float",
    "save_weights_file",
    "sft_samples",
    "solo_process_group",
    "warm_start",
]
