"""The reference GPT as a configuration of Megatron-core's GPTModel, and the name map.

The reference job trains with :class:`dynarl.backends.megatron.MegatronTrainer`; its
engines, log-prob scorers and hybrid replicas run :class:`~._gpt.ParallelGPT`'s math
(:mod:`._decoder` for incremental decoding, which GPTModel lacks on CPU). The two are one
architecture: pre-LayerNorm blocks with biases, a GELU MLP, learned absolute positions, an
untied output layer without bias, and one fused QKV per head as ``[q; k; v]`` rows —
Megatron's layout when every head is its own query group. :func:`megatron_model` is that
architecture as a :class:`~dynarl.backends.megatron.GPTModelConfig`;
:func:`to_megatron` and :func:`from_megatron` rename full state dicts between the two
(no tensor changes: the layouts are the same). Pure; runs anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dynarl.backends.megatron import GPTModelConfig
from dynarl.backends.reference._gpt import GPTConfig

__all__ = ["from_megatron", "megatron_model", "megatron_name", "to_megatron"]

_GLOBAL = {
    "embedding.weight": "embedding.word_embeddings.weight",
    "position.weight": "embedding.position_embeddings.weight",
    "final_ln.weight": "decoder.final_layernorm.weight",
    "final_ln.bias": "decoder.final_layernorm.bias",
    "output.weight": "output_layer.weight",
}
_LAYER = {
    "ln1": "input_layernorm",
    "qkv": "self_attention.linear_qkv",
    "proj": "self_attention.linear_proj",
    "ln2": "pre_mlp_layernorm",
    "fc1": "mlp.linear_fc1",
    "fc2": "mlp.linear_fc2",
}


def megatron_model(config: GPTConfig) -> GPTModelConfig:
    """The reference architecture ``config`` as a Megatron GPTModel (float32).

    Initial weights are drawn by Megatron from ``config.seed``, not by the reference
    model's per-name generators: a job's initial weights come from a file (the warm
    start) that both sides load through :func:`to_megatron`.
    """
    return GPTModelConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads,
        ffn_hidden_size=config.ffn_hidden_size,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_seq_len,
        normalization="LayerNorm",
        norm_epsilon=config.layernorm_eps,
        gated_mlp=False,
        add_bias_linear=True,
        position_embedding="learned_absolute",
        init_method_std=config.init_std,
        init_seed=config.seed,
    )


def megatron_name(name: str) -> str:
    """The GPTModel name of the reference parameter ``name``; ValueError for an unknown one."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"decoder.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    raise ValueError(f"{name!r} is not a parameter of the reference GPT")


def to_megatron(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reference full state dict under GPTModel's names (the same tensors)."""
    return {megatron_name(name): tensor for name, tensor in state.items()}


def from_megatron(state: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """GPTModel full tensors of ``config``'s model under the reference names, in the
    reference layout's order. Raises ValueError naming a missing parameter."""
    from dynarl.backends.reference._gpt import param_layout

    out: dict[str, torch.Tensor] = {}
    for shard in param_layout(config):
        name = megatron_name(shard.name)
        if name not in state:
            raise ValueError(f"the Megatron state lacks {name!r} (reference {shard.name!r})")
        out[shard.name] = state[name]
    return out
