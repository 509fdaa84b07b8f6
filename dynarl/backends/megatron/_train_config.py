"""Configuration of the Megatron trainer: the model's architecture and the training settings.

:class:`GPTModelConfig` describes a Llama/Qwen-style decoder (RMSNorm, SwiGLU, rotary
positions, grouped-query attention, optional biases and tied embeddings), dense or with a
mixture-of-experts MLP in every layer (Qwen-MoE style: a top-k router over routed SwiGLU
experts, no shared expert), in the terms both Megatron's ``TransformerConfig`` and a
Hugging Face ``config.json`` use, so one object builds the model, names its parameters for
the weight sync and reads or writes a checkpoint. :class:`MegatronTrainConfig` holds the
optimizer (Megatron's ``OptimizerConfig`` names), batching and loss settings. Pure data; no
Megatron import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from dynarl.backends._grpo import GRPOConfig
from dynarl.backends.hf_layout import GPTLayout
from dynarl.migrate import ExecutorConfig

__all__ = ["DTYPES", "GPTModelConfig", "MegatronTrainConfig"]

DTYPES = ("float32", "bfloat16", "float16")
"""Parameter dtypes the trainer builds models in."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTModelConfig:
    """Architecture of a Megatron ``GPTModel`` that maps one-to-one onto an HF Llama."""

    num_layers: int
    """Transformer layers (``num_hidden_layers``)."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Query heads."""
    ffn_hidden_size: int
    """Width of the MLP (``intermediate_size``)."""
    vocab_size: int
    """Token ids; must split evenly over every tensor-parallel size used (no padding)."""
    num_query_groups: int | None = None
    """Key/value heads (``num_key_value_heads``); None: one per query head."""
    head_dim: int | None = None
    """Width of one head (``kv_channels``); None: ``hidden_size // num_attention_heads``."""
    max_sequence_length: int = 2048
    """Longest sequence (``max_position_embeddings``)."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm layers."""
    norm_epsilon: float = 1e-5
    """Epsilon of the norms (``rms_norm_eps``)."""
    gated_mlp: bool = True
    """SwiGLU MLP (``gate_proj``/``up_proj``); False: a GELU MLP."""
    add_bias_linear: bool = False
    """Biases on every linear layer."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection only (Qwen2)."""
    tie_embeddings: bool = False
    """Output layer shares the input embedding (``tie_word_embeddings``); pp = 1 only."""
    position_embedding: Literal["rope", "learned_absolute"] = "rope"
    """Rotary positions (Llama, Qwen), or a learned table of ``max_sequence_length`` rows
    added to the token embedding (GPT-2 style; no HF Llama equivalent)."""
    rotary_base: float = 10000.0
    """Rotary base (``rope_theta``; unused with learned positions)."""
    params_dtype: str = "float32"
    """Parameter dtype, one of :data:`DTYPES` (CPU trainers: float32 only)."""
    init_method_std: float = 0.02
    """Standard deviation of the initial weights."""
    init_seed: int = 1234
    """Seed of the initial weights (drawn unsharded on the CPU: the same for every layout)."""
    num_experts: int | None = None
    """Routed experts of every layer's MLP (Megatron's ``num_moe_experts``, HF
    ``num_experts``); None: a dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF ``num_experts_per_tok``); MoE models only."""
    moe_ffn_hidden_size: int | None = None
    """Width of one expert's MLP (HF ``moe_intermediate_size``); None: ``ffn_hidden_size``."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 2 or self.max_sequence_length < 2:
            raise ValueError("GPTModelConfig.vocab_size and max_sequence_length must be >= 2")
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.query_groups})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                "hidden_size must be divisible by num_attention_heads (or set head_dim)"
            )
        if self.kv_channels < 1 or self.norm_epsilon <= 0 or self.init_method_std <= 0:
            raise ValueError("GPTModelConfig needs head_dim >= 1, norm_epsilon > 0, init std > 0")
        if self.params_dtype not in DTYPES:
            raise ValueError(f"params_dtype must be one of {DTYPES}, got {self.params_dtype!r}")
        if self.rotary_base <= 0:
            raise ValueError(f"rotary_base must be > 0, got {self.rotary_base}")
        if self.position_embedding not in ("rope", "learned_absolute"):
            raise ValueError(
                "position_embedding must be 'rope' or 'learned_absolute', "
                f"got {self.position_embedding!r}"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        if self.num_experts is not None and self.num_experts < 1:
            raise ValueError(f"GPTModelConfig.num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.moe_router_topk <= (self.num_experts or self.moe_router_topk):
            raise ValueError(
                f"GPTModelConfig.moe_router_topk must be in [1, num_experts], got "
                f"{self.moe_router_topk} for {self.num_experts} experts"
            )
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
            raise ValueError(
                f"GPTModelConfig.moe_ffn_hidden_size must be >= 1, got {self.moe_ffn_hidden_size}"
            )

    def hf_mismatches(self) -> list[str]:
        """The fields that keep this model from mapping onto an HF Llama/Qwen2 (empty: it
        maps): learned positions, LayerNorm, a GELU MLP, biases beyond the QKV ones."""
        out = []
        if self.position_embedding != "rope":
            out.append(f"position_embedding={self.position_embedding!r}")
        if self.normalization != "RMSNorm":
            out.append(f"normalization={self.normalization!r}")
        if not self.gated_mlp:
            out.append("gated_mlp=False")
        if self.add_bias_linear:
            out.append("add_bias_linear=True")
        return out

    @property
    def is_moe(self) -> bool:
        """Whether every layer's MLP is a mixture of experts."""
        return self.num_experts is not None

    @property
    def query_groups(self) -> int:
        """Key/value heads."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`params_dtype` as a torch dtype."""
        dtype: torch.dtype = getattr(torch, self.params_dtype)
        return dtype

    def hf_layout(self) -> GPTLayout:
        """The shape facts of the Megatron ↔ HF name and layout map.

        Tensors gathered along the layout's coordinates hold a gated ``linear_fc1`` as
        ``[gate; up]`` whatever the TP size (Megatron splits it with stride 2), hence
        ``fc1_tp_size=1``. Raises ValueError for a model with no HF Llama/Qwen2 equivalent
        (:meth:`hf_mismatches`).
        """
        mismatches = self.hf_mismatches()
        if mismatches:
            raise ValueError(f"the model has no HF Llama/Qwen2 layout: {', '.join(mismatches)}")
        return GPTLayout(
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.query_groups,
            head_dim=self.kv_channels,
            fc1_tp_size=1,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronTrainConfig:
    """Optimizer, batching, loss and device settings of a :class:`MegatronTrainer`."""

    lr: float = 1e-4
    """Learning rate (constant; schedule it with ``MegatronTrainer.set_lr``)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; not applied to biases and 1-D parameters."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    adam_eps: float = 1e-8
    """Adam ε."""
    clip_grad: float | None = 1.0
    """Clip the global gradient to this L2 norm; None: no clipping."""
    micro_batch_size: int = 4
    """Samples per micro-batch; micro-batch j runs on data-parallel rank ``j mod dp``."""
    temperature: float = 1.0
    """Log-probs are taken under ``logits / temperature`` (match the rollout's)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Loss settings."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model lives; ``auto``: CUDA when available (NCCL groups), else CPU (gloo)."""
    rng_seed: int = 1234
    """Seed of Megatron's model-parallel RNG tracker."""
    group_timeout_s: float = 60.0
    """Deadline for building a process group, seconds."""
    transfer: ExecutorConfig = field(default_factory=ExecutorConfig)
    """How gathers to one rank (weight sync, export, checksums) move their bytes."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.adam_eps <= 0 or self.weight_decay < 0:
            raise ValueError("MegatronTrainConfig needs lr > 0, adam_eps > 0, weight_decay >= 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError("MegatronTrainConfig adam betas must be in [0, 1)")
        if self.clip_grad is not None and self.clip_grad <= 0:
            raise ValueError(f"clip_grad must be > 0 or None, got {self.clip_grad}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.temperature <= 0 or self.group_timeout_s <= 0:
            raise ValueError("MegatronTrainConfig needs temperature > 0 and group_timeout_s > 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")

    def resolved_device(self) -> torch.device:
        """The device :attr:`device` names on this machine; ValueError for ``cuda`` without
        CUDA."""
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        if self.device == "cpu" or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())
