"""The transformer block every trainer model is built from: Megatron's local spec, with norms
that support sequence parallelism.

Megatron-core 0.16.1's local spec (``get_gpt_layer_local_spec``) builds its norms with
``WrappedTorchNorm``, which refuses ``sequence_parallel`` outright, and the only other
non-Transformer-Engine norm (Apex's ``FusedLayerNorm``) is neither installed here nor an
RMSNorm. Yet Megatron's MoE layer refuses to train with TP > 1 unless sequence parallelism
is on. A norm is per token, so running it on a rank's slice of the sequence needs only one
thing: its weights carry the ``sequence_parallel`` attribute, so that their gradients,
partial on each tensor-parallel rank, are summed over the TP group after the backward pass
(Megatron's ``finalize_model_grads`` does it for exactly the parameters so marked; Apex's and
TE's norms mark theirs the same way). :class:`SequenceParallelNorm` is the torch norm plus
that mark; :func:`block_spec` is the local spec with it in all three places (the two norms of
each layer and the final one) and, for a MoE model, Megatron's ``SequentialMLP`` experts
(``moe_grouped_gemm=False``: one ``linear_fc1``/``linear_fc2`` pair per expert). Without
sequence parallelism the norm is the very module the local spec builds.

Megatron is imported lazily; runs wherever a model is built.
"""

from __future__ import annotations

from typing import Any

import torch

from dynarl.backends.megatron._train_config import GPTModelConfig

__all__ = ["SequenceParallelNorm", "block_spec"]


class SequenceParallelNorm:
    """``torch.nn.RMSNorm`` or ``torch.nn.LayerNorm`` (as ``config.normalization`` says),
    its parameters marked ``sequence_parallel`` as ``config`` is. Built by Megatron's
    ``build_module`` with Megatron's norm signature (a class, as ``WrappedTorchNorm``:
    ``build_module`` returns a plain function uncalled). Raises ValueError for another
    kind of normalisation."""

    def __new__(  # type: ignore[misc]  # returns the torch module, as WrappedTorchNorm
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        kinds: dict[str, type[torch.nn.Module]] = {
            "RMSNorm": torch.nn.RMSNorm,
            "LayerNorm": torch.nn.LayerNorm,
        }
        if config.normalization not in kinds:
            raise ValueError(f"normalization {config.normalization!r}: RMSNorm or LayerNorm only")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        return norm


def block_spec(model: GPTModelConfig, config: Any, *, pp_rank: int) -> Any:
    """The ``TransformerBlockSubmodules`` of pipeline stage ``pp_rank`` of ``model`` under
    Megatron ``config``: the local layer spec (MoE layers when ``model.num_experts`` is set)
    with :class:`SequenceParallelNorm` norms, as many layers as Megatron builds there."""
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = get_gpt_layer_local_spec(
        num_experts=model.num_experts,
        moe_grouped_gemm=False,
        normalization=model.normalization,
    )
    norms = {"input_layernorm": SequenceParallelNorm, "pre_mlp_layernorm": SequenceParallelNorm}
    layer = replace(layer, submodules=replace(layer.submodules, **norms))
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=SequenceParallelNorm)
