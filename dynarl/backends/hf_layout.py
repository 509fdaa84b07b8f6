"""Megatron-core GPT names and layouts ↔ Hugging Face Llama/Qwen names and layouts.

Inference engines (SGLang, vLLM) load weights by HF checkpoint names, so the trainer
converts what it holds; nothing here depends on an engine. Every
Megatron tensor here is *full*: TP shards concatenated along :func:`partition_dim`. Two
tensors are not a plain rename:

- ``self_attention.linear_qkv`` interleaves per query group ``[q heads; k; v]``
  (``SelfAttention.get_query_key_value_tensors``); HF keeps ``q_proj``, ``k_proj``,
  ``v_proj`` apart. With fewer query groups than TP ranks the gathered tensor would repeat
  groups: gather one copy per group before converting.
- ``mlp.linear_fc1`` of a gated MLP holds ``[gate; up]`` *per TP rank*, so the gathered
  tensor is ``[gate_0; up_0; gate_1; up_1; ...]`` and splitting needs the TP size it was
  gathered from (:attr:`GPTLayout.fc1_tp_size`).

Local-spec names (``input_layernorm``, ``pre_mlp_layernorm``) and Transformer-Engine names
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) are both read; writing
back uses :attr:`GPTLayout.te_layernorm`. Pure functions on tensors (views where
possible); conversions round-trip bit for bit. Run on the rank that holds the full tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "GPTLayout",
    "hf_to_megatron",
    "megatron_to_hf",
    "merge_gated_fc1",
    "merge_qkv",
    "partition_dim",
    "split_gated_fc1",
    "split_qkv",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTLayout:
    """The shape facts a Megatron ↔ HF conversion needs (from the TransformerConfig)."""

    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (``num_key_value_heads`` in HF)."""
    head_dim: int
    """``kv_channels``: size of one head."""
    fc1_tp_size: int = 1
    """TP size whose ``linear_fc1`` shards were concatenated into the full tensor."""
    te_layernorm: bool = False
    """Write Transformer-Engine layernorm names (fused into ``linear_qkv``/``linear_fc1``)."""

    def __post_init__(self) -> None:
        for name in ("num_attention_heads", "num_query_groups", "head_dim", "fc1_tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_query_groups


def split_qkv(fused: torch.Tensor, layout: GPTLayout) -> tuple[torch.Tensor, ...]:
    """``linear_qkv`` weight or bias → ``(q, k, v)`` in HF row order."""
    groups, per_group, dim = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    rows = groups * (per_group + 2) * dim
    if fused.shape[0] != rows:
        raise ValueError(f"linear_qkv has {fused.shape[0]} rows, layout needs {rows}")
    view = fused.reshape(groups, per_group + 2, dim, *fused.shape[1:])
    q = view[:, :per_group].reshape(groups * per_group * dim, *fused.shape[1:])
    k = view[:, per_group].reshape(groups * dim, *fused.shape[1:])
    v = view[:, per_group + 1].reshape(groups * dim, *fused.shape[1:])
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: GPTLayout) -> torch.Tensor:
    """HF ``(q, k, v)`` → Megatron's group-interleaved ``linear_qkv``."""
    groups, per_group, dim = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    rest = q.shape[1:]
    if q.shape[0] != groups * per_group * dim or k.shape[0] != groups * dim or k.shape != v.shape:
        raise ValueError(f"q/k/v shapes {q.shape}, {k.shape}, {v.shape} do not fit {layout}")
    parts = (
        q.reshape(groups, per_group, dim, *rest),
        k.reshape(groups, 1, dim, *rest),
        v.reshape(groups, 1, dim, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_gated_fc1(fc1: torch.Tensor, tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered gated ``linear_fc1`` (``[gate_r; up_r]`` per rank) → ``(gate, up)``."""
    if fc1.shape[0] % (2 * tp_size):
        raise ValueError(f"linear_fc1 rows ({fc1.shape[0]}) not divisible by 2 × tp {tp_size}")
    rest = fc1.shape[1:]
    view = fc1.reshape(tp_size, 2, fc1.shape[0] // (2 * tp_size), *rest)
    return view[:, 0].reshape(-1, *rest), view[:, 1].reshape(-1, *rest)


def merge_gated_fc1(gate: torch.Tensor, up: torch.Tensor, tp_size: int) -> torch.Tensor:
    """``(gate, up)`` → gathered gated ``linear_fc1`` for ``tp_size`` ranks."""
    if gate.shape != up.shape or gate.shape[0] % tp_size:
        raise ValueError(f"gate {gate.shape} / up {up.shape} do not split over tp {tp_size}")
    rest = gate.shape[1:]
    parts = (
        gate.reshape(tp_size, 1, -1, *rest),
        up.reshape(tp_size, 1, -1, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_RENAME = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")


def partition_dim(megatron_name: str) -> int | None:
    """Dim along which TP shards of this Megatron tensor concatenate; None if replicated."""
    if megatron_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if megatron_name.endswith(_COLUMN):
        return 0
    if megatron_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def megatron_to_hf(
    tensors: Mapping[str, torch.Tensor], layout: GPTLayout, *, layer_offset: int = 0
) -> dict[str, torch.Tensor]:
    """Full Megatron GPT tensors → HF Llama/Qwen names and layouts.

    ``layer_offset`` is added to layer numbers (a pipeline stage's first global layer).
    ``*._extra_state`` entries are skipped. Raises ValueError on a name it does not know.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("._extra_state"):
            continue
        if name in _TOP:
            out[_TOP[name]] = tensor
            continue
        match = _LAYER.match(name)
        if match is None:
            raise ValueError(f"no HF name for Megatron tensor {name!r}")
        prefix = f"model.layers.{int(match.group(1)) + layer_offset}."
        rest = match.group(2)
        if rest in _RENAME:
            out[prefix + _RENAME[rest]] = tensor
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            suffix = rest.rsplit(".", 1)[1]
            for part, value in zip(("q", "k", "v"), split_qkv(tensor, layout), strict=True):
                out[f"{prefix}self_attn.{part}_proj.{suffix}"] = value
        elif rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
            suffix = rest.rsplit(".", 1)[1]
            gate, up = split_gated_fc1(tensor, layout.fc1_tp_size)
            out[f"{prefix}mlp.gate_proj.{suffix}"] = gate
            out[f"{prefix}mlp.up_proj.{suffix}"] = up
        else:
            raise ValueError(f"no HF name for Megatron tensor {name!r}")
    return out


_INVERSE = {
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.o_proj.bias": "self_attention.linear_proj.bias",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.down_proj.bias": "mlp.linear_fc2.bias",
}


def _megatron_rest(rest: str, layout: GPTLayout) -> str | None:
    if rest == "input_layernorm.weight":
        te = "self_attention.linear_qkv.layer_norm_weight"
        return te if layout.te_layernorm else "input_layernorm.weight"
    if rest == "post_attention_layernorm.weight":
        te = "mlp.linear_fc1.layer_norm_weight"
        return te if layout.te_layernorm else "pre_mlp_layernorm.weight"
    return _INVERSE.get(rest)


def hf_to_megatron(
    tensors: Mapping[str, torch.Tensor], layout: GPTLayout, *, layer_offset: int = 0
) -> dict[str, torch.Tensor]:
    """HF Llama/Qwen tensors → full Megatron GPT tensors (inverse of :func:`megatron_to_hf`).

    Layers numbered below ``layer_offset`` are refused; raises ValueError on an unknown
    name or an incomplete q/k/v or gate/up set.
    """
    top = {hf: megatron for megatron, hf in _TOP.items()}
    out: dict[str, torch.Tensor] = {}
    fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name in top:
            out[top[name]] = tensor
            continue
        match = _HF_LAYER.match(name)
        if match is None or int(match.group(1)) < layer_offset:
            raise ValueError(f"no Megatron name for HF tensor {name!r}")
        prefix = f"decoder.layers.{int(match.group(1)) - layer_offset}."
        rest = match.group(2)
        piece = re.fullmatch(r"(self_attn\.[qkv]|mlp\.gate|mlp\.up)_proj\.(weight|bias)", rest)
        if piece is not None:
            kind = "qkv" if piece.group(1).startswith("self_attn") else "fc1"
            fused.setdefault((prefix + kind, piece.group(2)), {})[piece.group(1)] = tensor
            continue
        target = _megatron_rest(rest, layout)
        if target is None:
            raise ValueError(f"no Megatron name for HF tensor {name!r}")
        out[prefix + target] = tensor
    for (key, suffix), parts in fused.items():
        prefix, kind = key.rsplit(".", 1)
        try:
            if kind == "qkv":
                value = merge_qkv(
                    parts["self_attn.q"], parts["self_attn.k"], parts["self_attn.v"], layout
                )
                out[f"{prefix}.self_attention.linear_qkv.{suffix}"] = value
            else:
                value = merge_gated_fc1(parts["mlp.gate"], parts["mlp.up"], layout.fc1_tp_size)
                out[f"{prefix}.mlp.linear_fc1.{suffix}"] = value
        except KeyError as exc:
            raise ValueError(f"{prefix}: {kind} {suffix} is missing {exc}") from exc
    return out
