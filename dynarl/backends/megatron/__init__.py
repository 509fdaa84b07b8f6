"""The Megatron-core trainer (extra ``megatron``): GPTModel under Megatron DDP on explicit
process groups, resharded by :class:`dynarl.migrate.P2PMigration`, synced to SGLang engines
and loaded from / exported to Hugging Face checkpoint directories.

- :class:`MegatronTrainer` — one rank of the trainer (:mod:`.trainer`); the model's
  architecture in :class:`GPTModelConfig`, training settings in :class:`MegatronTrainConfig`;
- :class:`MegatronTrainerRole` — the trainer as a runtime component (``name="trainer"``):
  streamed GRPO steps, checksums, grown and shrunk by P2P reshards; its options a
  :class:`MegatronSetup` (model, settings, initial weights, parallel sizes); with a KL
  term it scores micro-batches under the frozen initial weights (:class:`ReferencePolicy`);
- :func:`sync_weights` — gather to one rank, Megatron → HF names and layouts, bucketed
  broadcast to SGLang engines, ``/weights_checker`` verification (:mod:`.sync`);
  :func:`sync_weights_vllm` the same into vLLM engines through a
  :class:`~dynarl.backends.vllm.WeightPusher`; :func:`push_to_engines` to every
  :class:`EngineTarget` a rollout names, either kind (the role's ``push_weights`` call;
  :func:`engine_targets` turns a serving role's ``engine_address`` results into its option);
- :func:`load_hf_checkpoint` / :func:`export_hf_checkpoint` — local HF directories
  (safetensors or torch ``.bin``, sharded or not) with the same name map (:mod:`.checkpoint`).

Importing this package does not import Megatron; building a trainer does (after the CPU
shim, which applies only without CUDA). On CPU Megatron's optimizer cannot run, so the
trainer steps with ``torch.optim.AdamW`` on DDP's ``main_grad`` (see :mod:`.optimizer`).
"""

from __future__ import annotations

from dynarl.backends.megatron._gpt_model import describe
from dynarl.backends.megatron._hf_checkpoint import (
    export_hf_checkpoint,
    hf_config,
    load_hf_checkpoint,
    model_config_from_hf,
    read_hf_tensors,
    write_hf_tensors,
)
from dynarl.backends.megatron._megatron_trainer import MegatronTrainer
from dynarl.backends.megatron._reference_policy import ReferencePolicy
from dynarl.backends.megatron._role import MegatronTrainerRole, engine_targets
from dynarl.backends.megatron._setup import MegatronSetup
from dynarl.backends.megatron._sync import (
    EngineTarget,
    SyncReport,
    check_hf_compatible,
    from_hf,
    hf_names,
    push_to_engines,
    sync_weights,
    sync_weights_vllm,
    to_hf,
)
from dynarl.backends.megatron._train_config import DTYPES, GPTModelConfig, MegatronTrainConfig

__all__ = [
    "DTYPES",
    "EngineTarget",
    "GPTModelConfig",
    "MegatronSetup",
    "MegatronTrainConfig",
    "MegatronTrainer",
    "MegatronTrainerRole",
    "ReferencePolicy",
    "SyncReport",
    "check_hf_compatible",
    "describe",
    "engine_targets",
    "export_hf_checkpoint",
    "from_hf",
    "hf_config",
    "hf_names",
    "load_hf_checkpoint",
    "model_config_from_hf",
    "push_to_engines",
    "read_hf_tensors",
    "sync_weights",
    "sync_weights_vllm",
    "to_hf",
    "write_hf_tensors",
]
