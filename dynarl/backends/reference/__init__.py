"""The reference CPU backend: a real, small RL stack that runs anywhere torch runs.

* model: :class:`GPTConfig`, :class:`ParallelGPT` (Megatron-core tensor-parallel layers,
  gloo on CPU);
* rollout: :class:`RolloutEngine` (:class:`EngineConfig`; continuous batching,
  per-sequence KV cache, prefix cache, injected request queue, abort with partial output,
  KV utilization, sampling keyed by seed, sample id and position, a batch-invariant
  deterministic mode), driven episode by episode by :func:`collect_rollouts`;
* inference and tools: :class:`LogProbWorker`, :class:`ToolWorker` (a calculator behind
  a :class:`ToolLatency`);
* training: the production trainer, :class:`dynarl.backends.megatron.MegatronTrainer`,
  with the reference architecture as a Megatron GPTModel (:func:`megatron_model`; the
  names map both ways with :func:`to_megatron` / :func:`from_megatron`; settings in a
  :class:`~dynarl.backends.megatron.MegatronTrainConfig`, :func:`default_train`);
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
from dynarl.backends.reference._megatron_model import from_megatron, megatron_model, to_megatron
from dynarl.backends.reference._rollout_engine import EngineConfig, RolloutEngine
from dynarl.backends.reference._samples import GROUP, SEED_ID, meta_float
from dynarl.backends.reference._serving import ReferenceInference, ReferenceRollout, ReferenceTools
from dynarl.backends.reference._setup import (
    ReferenceSetup,
    default_train,
    save_weights_file,
    warm_start,
)
from dynarl.backends.reference._staleness import MessageQueue
from dynarl.backends.reference._tasks import ChainSumTask, Problem, Task, ToolCalcTask, sft_samples
from dynarl.backends.reference._tokenizer import CharTokenizer
from dynarl.backends.reference._tools import ToolLatency, ToolWorker

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
    "collect_rollouts",
    "default_train",
    "from_megatron",
    "megatron_model",
    "meta_float",
    "save_weights_file",
    "sft_samples",
    "solo_process_group",
    "to_megatron",
    "warm_start",
]
