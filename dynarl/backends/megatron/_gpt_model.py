"""Megatron-core GPTModel on a layout's own groups: build, describe, wrap in DDP, score.

Every model is built on the process groups of one layout (:class:`LayoutGroups`, passed as
a ``ProcessGroupCollection``), never on ``initialize_model_parallel``. Initial weights are
drawn unsharded on the CPU from :attr:`GPTModelConfig.init_seed` (Megatron's CPU
initialisation), so every layout starts from the same values; a model built to receive a
reshard skips initialisation and gets its tensor-parallel attributes from the model's
description instead (Megatron sets them only while initialising).
:func:`describe` reads that description from a one-rank model on the ``meta`` device: no
memory, no collective, the same for every layout.

Megatron is imported lazily, after :func:`dynarl.backends._cpu_compat.apply_cpu_shim`
(a no-op where CUDA exists). Runs on each trainer rank.
"""

from __future__ import annotations

import contextlib
import uuid
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dynarl.backends._cpu_compat import apply_cpu_shim
from dynarl.backends.megatron._layer_spec import block_spec
from dynarl.backends.megatron._train_config import GPTModelConfig
from dynarl.migrate import (
    CommGroup,
    LayoutGroups,
    LayoutSpec,
    ParamSpec,
    build_group,
    param_names,
    param_specs,
    process_group_collection,
)

__all__ = [
    "build_gpt",
    "causal_inputs",
    "describe",
    "import_megatron",
    "initial_parameters",
    "pg_collection",
    "set_tp_attributes",
    "token_logprobs",
    "wrap_ddp",
]


def import_megatron() -> None:
    """Apply the CPU shim (only without CUDA) and import the Megatron modules used here.

    Megatron announces missing optional kernels (TE, Apex) and its own module moves with
    warnings at import; they are silenced for this one import.
    """
    apply_cpu_shim()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.distributed
        import megatron.core.models.gpt
        import megatron.core.models.gpt.gpt_layer_specs
        import megatron.core.optimizer  # noqa: F401
        from megatron.core.transformer.moe import moe_utils
    # Without Transformer Engine, Megatron-core 0.16.1 leaves ``te_general_gemm`` unbound
    # (its ImportError branch sets only HAVE_TE) yet the router's gating reads it: every MoE
    # forward would raise NameError. None is the value that branch means.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def transformer_config(
    model: GPTModelConfig, spec: LayoutSpec, *, init: bool, cpu_init: bool
) -> Any:
    """Megatron's ``TransformerConfig`` for ``model`` at ``spec``'s parallel sizes.

    Dropout is off and fused kernels are not used; the loss is per token (gradients are
    summed over data-parallel ranks, not averaged: the caller normalises). A MoE model is
    dropless, routes with the ``allgather`` dispatcher (the ``alltoall`` one creates CUDA
    streams) and has no load-balancing loss: Megatron scales that loss by the loss scale of
    its own pipeline schedules, which the trainer does not run.
    """
    from megatron.core.transformer import TransformerConfig

    dtype = model.torch_dtype
    return TransformerConfig(
        **_moe_fields(model, spec),
        sequence_parallel=spec.sequence_parallel,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cpu_init,
        perform_initialization=init,
        init_method_std=model.init_method_std,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.gated_mlp,
        activation_func=torch.nn.functional.silu if model.gated_mlp else _gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias or model.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,
        cuda_graph_scope=[],  # the default ("full") warns that it is deprecated
    )


def _moe_fields(model: GPTModelConfig, spec: LayoutSpec) -> dict[str, Any]:
    if model.num_experts is None:
        return {}
    return {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.moe_router_topk,
        "moe_ffn_hidden_size": model.moe_ffn_hidden_size or model.ffn_hidden_size,
        "moe_token_dispatcher_type": "allgather",
        "moe_router_load_balancing_type": "none",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": spec.ep,
        "expert_tensor_parallel_size": spec.etp,
    }


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x)


def pg_collection(groups: LayoutGroups, whole: CommGroup | None = None) -> Any:
    """The ``ProcessGroupCollection`` of a layout, with the groups Megatron's optimizer and
    router also read: expert TP × EP × PP (without expert groups: model parallelism), the
    one distributed-optimizer instance, ``whole`` (every rank of the layout; the
    data-parallel group when not given, for a caller that builds no distributed optimizer),
    and ``tp_dp_cp``, None: only the router's global load-balancing loss reads it, and the
    trainer's MoE models have none."""
    collection = process_group_collection(groups)
    collection.tp_ep_pp = groups.groups.get("tp_ep_pp", groups.groups["mp"]).pg
    collection.intra_dist_opt = (whole or groups.groups["dp"]).pg
    collection.tp_dp_cp = None
    return collection


def build_gpt(
    model: GPTModelConfig,
    spec: LayoutSpec,
    groups: LayoutGroups,
    *,
    rank: int,
    init: bool,
    device: torch.device,
) -> torch.nn.Module:
    """This rank's pipeline stage of ``model`` under ``spec``, on ``device``.

    ``init``: draw the initial weights (unsharded, on the CPU, from ``init_seed``, without
    touching the global RNG); otherwise the parameters are allocated only. Raises
    ValueError when ``rank`` is not in ``spec``.
    """
    from megatron.core.models.gpt import GPTModel

    _, _, pp_rank = spec.coords(rank)
    config = transformer_config(model, spec, init=init, cpu_init=init or device.type == "cpu")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # The local layer spec leaves the MLP's size to the config, which Megatron flags.
        warnings.filterwarnings("ignore", "MLP requires ffn_hidden_size", DeprecationWarning)
        torch.manual_seed(model.init_seed)
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(model, config, pp_rank=pp_rank),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_sequence_length,
            position_embedding_type=model.position_embedding,
            rotary_base=int(model.rotary_base),
            share_embeddings_and_output_weights=model.tie_embeddings,
            pre_process=pp_rank == 0,
            post_process=pp_rank == spec.pp - 1,
            pg_collection=pg_collection(groups),
        )
    # Megatron's training loop casts a half-precision model whole (Float16Module); the local
    # spec's torch norms would otherwise stay float32 beside bfloat16 matrices.
    module: torch.nn.Module = gpt.to(device=device, dtype=model.torch_dtype)
    return module


def describe(model: GPTModelConfig) -> list[ParamSpec]:
    """Every parameter of ``model`` (whole model, registration order), read from a one-rank
    instance on the ``meta`` device over a private one-rank group. Cheap for any size."""
    with _one_rank(model, torch.device("meta")) as gpt:
        return param_specs(gpt, tp=1)


def initial_parameters(model: GPTModelConfig) -> dict[str, torch.Tensor]:
    """The full initial weights of ``model`` on the CPU, by global name, as a one-rank
    instance draws them from ``init_seed``.

    Every layout without expert parallelism draws exactly these (Megatron's CPU
    initialisation draws each weight whole, then cuts this rank's part). An expert-parallel
    rank draws only its own experts, from the same seed, so its experts and every weight
    after them would differ from layout to layout: the trainer loads these instead. Holds
    one full model in memory.
    """
    with _one_rank(model, torch.device("cpu")) as gpt:
        return {name: param.detach() for _, name, param in param_names(gpt)}


@contextlib.contextmanager
def _one_rank(model: GPTModelConfig, device: torch.device) -> Iterator[torch.nn.Module]:
    """An initialised whole ``model`` on ``device`` over a private one-rank group."""
    import_megatron()
    name = f"dynarl/one-rank/{uuid.uuid4().hex}"
    group = build_group(dist.HashStore(), name=name, ranks=(0,), rank=0)  # type: ignore[attr-defined]
    groups = LayoutGroups(
        epoch=-1,
        spec=LayoutSpec(ranks=(0,)),
        groups={kind: group for kind in ("tp", "dp", "pp", "mp", "cp", "embd", "pos_embd")},
    )
    try:
        with device:
            yield build_gpt(model, groups.spec, groups, rank=0, init=True, device=device)
    finally:
        group.close()


def set_tp_attributes(module: torch.nn.Module, specs: Sequence[ParamSpec]) -> None:
    """Give every parameter Megatron's tensor-parallel attributes from its description
    (models built without initialisation lack them; gradient norms and DDP read them)."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    by_name = {spec.name: spec for spec in specs}
    for _, name, param in param_names(module):
        spec = by_name[name]
        if hasattr(param, "tensor_model_parallel"):
            continue
        if spec.tp_dim is not None:
            set_tensor_model_parallel_attributes(param, True, spec.tp_dim, spec.tp_stride)
        else:
            set_tensor_model_parallel_attributes(param, False, -1, 1)


def wrap_ddp(module: torch.nn.Module, spec: LayoutSpec, groups: LayoutGroups) -> Any:
    """Megatron ``DistributedDataParallel`` over the layout's groups: one bucket per dtype,
    fp32 gradient reduction, the distributed optimizer's buffer layout when the layout
    shards optimizer state. Raises ValueError for a layout with ``bucket_size`` set."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if spec.bucket_size is not None or spec.pad_buckets_for_high_nccl_busbw:
        raise ValueError("MegatronTrainer uses one DDP bucket per dtype: set bucket_size=None")
    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=spec.distributed_optimizer,
    )
    return DistributedDataParallel(
        config=module.config,
        ddp_config=config,
        module=module,
        pg_collection=pg_collection(groups),
    )


def causal_inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids ``(b, s)`` and the explicit causal mask ``(1, 1, s, s)`` (True: masked)
    for ``tokens`` (Megatron's default mask is built on CUDA)."""
    batch, length = tokens.shape
    position = torch.arange(length, device=tokens.device).expand(batch, length)
    mask = torch.ones(1, 1, length, length, dtype=torch.bool, device=tokens.device)
    return position, torch.triu(mask, diagonal=1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``out[i, t] = log p(tokens[i, t + 1] | tokens[i, : t + 1])`` from vocab-parallel
    ``logits`` ``(b, s, vocab / tp)``; shape ``(b, s - 1)``. Collective over the installed
    tensor-parallel group (Megatron's vocab-parallel cross entropy)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits[:, :-1].float() / temperature
    loss: torch.Tensor = vocab_parallel_cross_entropy(scaled, tokens[:, 1:])
    return -loss
