"""Megatron MoE names ↔ Hugging Face Qwen-MoE names: the router and the routed experts.

The dense part of a layer (attention, norms, embeddings) maps as in
:mod:`dynarl.backends.hf_layout`; this module maps what a MoE layer adds, as Megatron's
local spec names it under global expert indices (``SequentialMLP``;
:func:`dynarl.migrate.param_names`) and as Qwen3-MoE and Qwen2-MoE checkpoints name it:

- ``decoder.layers.L.mlp.router.weight`` ↔ ``model.layers.L.mlp.gate.weight``;
- ``decoder.layers.L.mlp.experts.local_experts.E.linear_fc1.weight`` ↔
  ``model.layers.L.mlp.experts.E.gate_proj.weight`` and ``….up_proj.weight``;
- ``decoder.layers.L.mlp.experts.local_experts.E.linear_fc2.weight`` ↔
  ``model.layers.L.mlp.experts.E.down_proj.weight``.

Both sides hold the router as ``(num_experts, hidden)`` and the expert matrices in
``nn.Linear`` orientation, so only the gated ``linear_fc1`` is more than a rename: a full
tensor gathered along the layout's coordinates is ``[gate; up]`` whatever the expert-TP size
(Megatron splits it with stride 2), split and joined with ``fc1_tp_size=1``. Shared experts
(Qwen2-MoE's ``shared_expert``) are not built by the trainer and have no entry. Pure
functions on full tensors (views where possible); round trips are bitwise.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from dynarl.backends.hf_layout import merge_gated_fc1, split_gated_fc1

__all__ = ["is_moe_hf_name", "is_moe_name", "moe_from_hf", "moe_to_hf"]

_ROUTER = re.compile(r"^decoder\.layers\.(?P<layer>\d+)\.mlp\.router\.weight$")
_EXPERT = re.compile(
    r"^decoder\.layers\.(?P<layer>\d+)\.mlp\.experts\.local_experts\.(?P<expert>\d+)"
    r"\.linear_(?P<fc>fc1|fc2)\.weight$"
)
_HF_ROUTER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.gate\.weight$")
_HF_EXPERT = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)"
    r"\.(?P<proj>gate|up|down)_proj\.weight$"
)


def is_moe_name(name: str) -> bool:
    """Whether Megatron tensor ``name`` is a router or routed-expert weight."""
    return bool(_ROUTER.match(name) or _EXPERT.match(name))


def is_moe_hf_name(name: str) -> bool:
    """Whether HF tensor ``name`` is a router (``mlp.gate``) or routed-expert weight."""
    return bool(_HF_ROUTER.match(name) or _HF_EXPERT.match(name))


def moe_to_hf(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full Megatron router and expert weights → HF Qwen-MoE names. Raises ValueError on
    any other name."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        router, expert = _ROUTER.match(name), _EXPERT.match(name)
        if router is not None:
            out[f"model.layers.{router['layer']}.mlp.gate.weight"] = tensor
        elif expert is not None:
            head = f"model.layers.{expert['layer']}.mlp.experts.{expert['expert']}"
            if expert["fc"] == "fc2":
                out[f"{head}.down_proj.weight"] = tensor
            else:
                gate, up = split_gated_fc1(tensor, 1)
                out[f"{head}.gate_proj.weight"], out[f"{head}.up_proj.weight"] = gate, up
        else:
            raise ValueError(f"{name!r} is not a Megatron router or expert weight")
    return out


def moe_from_hf(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF Qwen-MoE router and expert weights → full Megatron tensors (inverse of
    :func:`moe_to_hf`). Raises ValueError on any other name and on an expert with a gate
    but no up projection or the reverse."""
    out: dict[str, torch.Tensor] = {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        router, expert = _HF_ROUTER.match(name), _HF_EXPERT.match(name)
        if router is not None:
            out[f"decoder.layers.{router['layer']}.mlp.router.weight"] = tensor
        elif expert is not None:
            head = f"decoder.layers.{expert['layer']}.mlp.experts.local_experts.{expert['expert']}"
            if expert["proj"] == "down":
                out[f"{head}.linear_fc2.weight"] = tensor
            else:
                halves.setdefault(head, {})[expert["proj"]] = tensor
        else:
            raise ValueError(f"{name!r} is not an HF router or expert weight")
    for head, parts in halves.items():
        if set(parts) != {"gate", "up"}:
            raise ValueError(f"{head}: gate_proj and up_proj come together, got {sorted(parts)}")
        out[f"{head}.linear_fc1.weight"] = merge_gated_fc1(parts["gate"], parts["up"], 1)
    return out
