"""Shared builders of the CP and VPP GPU tests (``test_megatron_cp_gpu.py``,
``test_megatron_vpp_gpu.py``): models, Megatron optimizers and schedules on dynarl's
layout groups, checks and tolerances. What the tests check and why is in their docstrings;
the design notes below apply to both.

Context parallelism and the interleaved pipeline, trained on CUDA (marker ``gpu``).

dynarl plans context-parallel (CP) and virtual-pipeline (VPP) layouts on the CPU
(tests/unit, tests/prop) but cannot train them there: Megatron-core 0.16.1 builds
context-parallel attention only with Transformer Engine (``TEDotProductAttention``; its
local ``DotProductAttention`` asserts ``context_parallel_size == 1``), and its interleaved
1F1B schedule allocates on CUDA. ``MegatronTrainer`` trains neither (it builds TP, PP, DP
and EP layouts and drives pipeline stages one micro-batch at a time), so this file builds
the models, Megatron DDP and Megatron's optimizer itself, with Megatron's own APIs
(``GPTModel(vp_stage=...)``, ``get_forward_backward_func``, ``P2PCommunicator``,
``get_batch_on_this_cp_rank``), on the process groups of dynarl's layouts
(:class:`LayoutGroups`), and checks them against those layouts.

Two GPUs, one rank on each (NCCL refuses two ranks of one communicator on one device):

1. CP 2 (Transformer Engine needed): a bf16 GPT with the distributed optimizer (state sharded
   over dp × cp) at (TP 1, CP 2, DP 1). Its parameter shards match ``sharded_state_dict()``
   and the optimizer's flat ranges match the layout's; three steps match a CP 1 run from the
   same weights (losses and the first step's gradients, bf16 tolerances below); a P2P reshard
   to CP 1 on one rank moves optimizer state and keeps the whole state bitwise, and the next
   step equals, bitwise, that of a CP 1 model restarted from the gathered state.
2. PP 2 × VPP 2: a four-layer fp32 GPT, one layer per model chunk, trained three steps with
   the interleaved schedule. Each chunk holds exactly the parameters ``pipeline_chunks`` gives
   its (pipeline rank, virtual stage), shaped as ``sharded_state_dict()`` says; its losses and
   its parameters (gathered through the layout) match a PP 1 run (fp32 tolerances below).

One GPU (what a one-GPU host can check of the above): the PP 1 run through Megatron's
schedule reproduces ``MegatronTrainer.sft_step``; the CP 1 model with TE attention matches
``MegatronTrainer`` (local attention) within the bf16 tolerance, and its layout checks pass.

The heavy work runs in spawned processes (:func:`migrate_ranks.run_ranks`), one per GPU, so
that Megatron's process-wide state and TE's warnings stay out of the pytest process.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dynarl.backends._grpo import TrainSample, pad_samples
from dynarl.backends.megatron import GPTModelConfig, MegatronTrainConfig
from dynarl.backends.megatron._gpt_model import (
    causal_inputs,
    import_megatron,
    initial_parameters,
    pg_collection,
    set_tp_attributes,
    transformer_config,
)
from dynarl.backends.megatron._layer_spec import block_spec
from dynarl.backends.megatron._optimizer import _init_adam_state, param_groups
from dynarl.migrate import (
    CommGroup,
    ExecutorConfig,
    Layout,
    LayoutGroups,
    LayoutSpec,
    ParamSpec,
    Shard,
    execute_plan,
    install_parallel_state,
    param_names,
    plan_reshard,
)

BACKEND = "nccl"
"""Backend of every group built here."""
DEVICE = "cuda"
"""Where the models live (each rank's current GPU)."""
TIMEOUT = timedelta(seconds=120)
"""Deadline for building a group."""
SEQ = 64
"""Tokens per sequence: a multiple of 2 * cp, as Megatron's load-balanced CP split needs."""
MICRO = 2
"""Sequences per micro-batch (four micro-batches per step: the interleaved schedule needs
at least pp of them, in groups of pp)."""
STEPS = 3
"""Training steps compared."""

CP_LOSS_RTOL = 1e-2
"""CP 2 vs CP 1 (and TE vs local attention), per-step loss, relative. The model is bf16:
TE's context-parallel attention exists only in its flash and cuDNN fused kernels, which
take fp16/bf16 (its fp32 'unfused' attention has no CP), so CP rounds the partial
attention outputs and the per-rank weight-gradient sums to bf16 where CP 1 rounds whole
ones; bf16 keeps 8 significant bits (2**-8 = 3.9e-3), and 1e-2 is about 2.5 of those."""
CP_GRAD_RTOL = 2e-2
"""CP 2 vs CP 1, the first step's gradients (fp32 ``main_grad`` of bf16 backward passes):
``|g_cp2 - g_cp1| / |g_cp1|`` over all parameters (L2), about 5 bf16 roundings."""
VPP_LOSS_RTOL = 1e-5
"""PP 2 × VPP 2 vs PP 1 (and the PP 1 schedule vs MegatronTrainer), per-step loss,
relative, fp32. Both run the same kernels on the same shapes in the same micro-batch
order, so they agree to the last bit in practice; Megatron does not promise it across
schedules, and 1e-5 (about 80 float32 ulps) is far below what a misplaced layer or a
lost gradient does (O(1e-2) and more)."""
VPP_PARAM_RTOL = 1e-3
"""PP 2 × VPP 2 vs PP 1, the parameters after training: the L2 norm of the difference of
their updates over the L2 norm of the PP 1 update. Adam turns any difference of a
near-zero gradient's sign into a full-size (lr) step of one element, hence a norm and
not an element-wise bound; a wrong chunk gives O(1)."""

CP_MODEL = GPTModelConfig(
    num_layers=2, hidden_size=128, num_attention_heads=2, ffn_hidden_size=256,
    vocab_size=256, max_sequence_length=SEQ, params_dtype="bfloat16", init_seed=11,
)  # fmt: skip
"""Head size 64 (every TE attention backend takes it); bf16, with fp32 master weights."""
VPP_MODEL = GPTModelConfig(
    num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=128, vocab_size=256, max_sequence_length=SEQ, init_seed=13,
)  # fmt: skip
"""Four layers: one per model chunk at PP 2 × VPP 2; fp32."""
TRAIN = MegatronTrainConfig(
    lr=1e-3, clip_grad=None, micro_batch_size=MICRO, device="cuda", group_timeout_s=120
)
"""No clipping: a norm summed in another order would scale the step by another ulp."""


def samples(seed: int) -> list[TrainSample]:
    """A global batch: eight sequences of SEQ tokens, the first five targets masked (a
    prompt). Every training step here takes batch 0 (so the loss must fall); the restart
    check takes batch 9."""
    gen = torch.Generator().manual_seed(100 + seed)
    mask = (False,) * 5 + (True,) * (SEQ - 6)
    return [
        TrainSample(
            tokens=tuple(torch.randint(0, 256, (SEQ,), generator=gen).tolist()), loss_mask=mask
        )
        for _ in range(8)
    ]


def te_missing() -> str | None:
    """Why Transformer Engine cannot be used here (None when it can)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken install (CUDA/ABI mismatch)
        return (
            "context parallelism needs Transformer Engine: Megatron-core 0.16.1 builds it only "
            "as TEDotProductAttention (its local DotProductAttention asserts "
            f"context_parallel_size == 1); import transformer_engine.pytorch failed: {exc!r}"
        )
    return None


def need_te() -> None:
    """Skip, saying why, unless Transformer Engine imports."""
    reason = te_missing()
    if reason is not None:
        pytest.skip(reason)


TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"needs 2 GPUs, found {torch.cuda.device_count()}: each of the two ranks drives "
    "its own GPU (NCCL refuses two ranks of one communicator on one device)",
)


# ---------------------------------------------------------------------- building blocks
def start_rank(rank: int, world: int, port: int) -> Any:
    """This process as rank ``rank`` of ``world``: its GPU, TE's deterministic attention
    kernels (the restart check compares bitwise), the job's store, a world group and
    Megatron imported. Megatron DDP reads the world group; Megatron's unbatched P2P sends
    one direction of a two-stage pipeline over it, hence NCCL for CUDA tensors."""
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT)
    dist.init_process_group(
        "gloo" if DEVICE == "cpu" else "cpu:gloo,cuda:nccl",
        store=dist.PrefixStore("world", store),
        rank=rank,
        world_size=world,
    )
    import_megatron()
    return store


@functools.cache
def initial(model: GPTModelConfig) -> dict[str, torch.Tensor]:
    """The whole model's initial weights by global name (a one-rank draw from its seed):
    every layout here starts from them (a pipeline chunk's own draw would differ)."""
    return initial_parameters(model)


def te_attention() -> type:
    """Transformer Engine's core attention, the one Megatron supports with CP > 1."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    cls: type = TEDotProductAttention
    return cls


def with_core_attention(block: Any, core_attention: type) -> Any:
    """``block`` (``TransformerBlockSubmodules``) with ``core_attention`` in every layer;
    the linear layers and norms, and so the parameters and their names, stay as they are."""
    layer = block.layer_specs[0]
    attention = layer.submodules.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, core_attention=core_attention),
    )
    layer = dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention)
    )
    return dataclasses.replace(block, layer_specs=[layer] * len(block.layer_specs))


def megatron_config(model: GPTModelConfig, spec: LayoutSpec, *, init: bool) -> Any:
    """dynarl's ``TransformerConfig`` for ``model`` at ``spec`` with the two sizes the
    trainer leaves out: ``context_parallel_size`` and ``virtual_pipeline_model_parallel_size``
    (which also sets ``microbatch_group_size_per_vp_stage = pp``).

    With a virtual pipeline the P2P exchanges are not batched: with PP 2 the previous and
    the next stage are one peer, and a batched exchange posts its two sends and two
    receives to it in an order that pairs an activation with a gradient (same shape:
    silently wrong; Megatron-LM issues 750 and 1450). Megatron-LM allows interleaving on
    PP 2 only with ``overlap_p2p_comm``, which splits the two directions.
    """
    base = transformer_config(model, spec, init=init, cpu_init=init or DEVICE == "cpu")
    interleaved = spec.vpp > 1
    return dataclasses.replace(
        base,
        context_parallel_size=spec.cp,
        virtual_pipeline_model_parallel_size=spec.virtual_pipeline if interleaved else None,
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
    )


def build_chunk(
    model: GPTModelConfig,
    spec: LayoutSpec,
    groups: LayoutGroups,
    *,
    rank: int,
    vp_stage: int | None,
    init: bool,
    specs: Sequence[ParamSpec],
    core_attention: type | None = None,
) -> torch.nn.Module:
    """This rank's model chunk ``vp_stage`` (None without a virtual pipeline) as
    ``build_gpt`` builds a stage, on ``groups``; with ``init`` its parameters are the
    whole model's initial weights, otherwise zeros (to be written by a reshard)."""
    from megatron.core.models.gpt import GPTModel

    config = megatron_config(model, spec, init=init)
    pp_rank = spec.coord(rank, "pp")
    layers = block_spec(model, config, pp_rank=pp_rank)
    if core_attention is not None:
        layers = with_core_attention(layers, core_attention)
    stage = vp_stage or 0
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "MLP requires ffn_hidden_size", DeprecationWarning)
        torch.manual_seed(model.init_seed)
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=layers,
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_sequence_length,
            position_embedding_type=model.position_embedding,
            rotary_base=int(model.rotary_base),
            pre_process=pp_rank == 0 and stage == 0,
            post_process=pp_rank == spec.pp - 1 and stage == spec.vpp - 1,
            pg_collection=pg_collection(groups),
            vp_stage=vp_stage,
        )
    module: torch.nn.Module = gpt.to(device=DEVICE, dtype=model.torch_dtype)
    set_tp_attributes(module, specs)
    full = initial(model) if init else {}
    with torch.no_grad():
        for _, name, param in param_names(module):
            if init:
                param.copy_(full[name])
            else:
                param.zero_()
    return module


def activate(groups: LayoutGroups) -> None:
    """Point Megatron's globals at ``groups`` and seed its RNG tracker, as the trainer
    does when a layout becomes current (its attention forks the tracker)."""
    from megatron.core import tensor_parallel

    install_parallel_state(groups)
    tensor_parallel.model_parallel_cuda_manual_seed(TRAIN.rng_seed)


def chunk_optimizer(ddps: Sequence[Any], groups: LayoutGroups) -> Any:
    """Megatron's fp32 Adam over every chunk (``MegatronAdamW`` takes one), built as the
    trainer builds its own, zero state created up front."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_megatron_optimizer_based_on_param_groups,
    )

    config = OptimizerConfig(
        optimizer="adam", lr=TRAIN.lr, weight_decay=TRAIN.weight_decay,
        adam_beta1=TRAIN.adam_beta1, adam_beta2=TRAIN.adam_beta2, adam_eps=TRAIN.adam_eps,
        clip_grad=0.0, params_dtype=torch.float32,
    )  # fmt: skip
    mp, dp = groups.groups["mp"].pg, groups.groups["dp"].pg
    optimizer = _get_megatron_optimizer_based_on_param_groups(
        config=config,
        model_chunks=list(ddps),
        param_groups=param_groups(torch.nn.ModuleList(ddps), TRAIN.weight_decay),
        per_model_buffers={i: ddp.buffers for i, ddp in enumerate(ddps)},
        model_parallel_group=mp,
        data_parallel_group=dp,
        data_parallel_group_gloo=None,
        data_parallel_group_idx=mp.rank(),
        intra_dist_opt_group=dp,
        distributed_optimizer_instance_id=0,
        pg_collection=pg_collection(groups),
    )
    _init_adam_state(optimizer.optimizer)
    return optimizer


def micro_batches(batch: Sequence[TrainSample]) -> tuple[list[dict[str, torch.Tensor]], float]:
    """``batch`` cut as the trainer cuts it (MICRO sequences each, in order) into Megatron
    batch dicts with a label and a loss-mask entry per position (the last has no target),
    and the batch's policy-token count (every loss is divided by it)."""
    out = []
    for i in range(0, len(batch), MICRO):
        tokens, mask = pad_samples(batch[i : i + MICRO])
        out.append(
            {
                "tokens": tokens,
                "labels": torch.nn.functional.pad(tokens[:, 1:], (0, 1)),
                "loss_mask": torch.nn.functional.pad(mask, (0, 1)),
                "position_ids": torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1),
            }
        )
    moved = [{k: v.to(DEVICE) for k, v in micro.items()} for micro in out]
    return moved, float(sum(sum(s.loss_mask) for s in batch))


def forward_step_func(normalizer: float, cp_group: Any, explicit_mask: bool) -> Callable[..., Any]:
    """Megatron's ``forward_step_func``: this CP rank's share of the next micro-batch
    (``get_batch_on_this_cp_rank``: chunks r and 2cp-1-r of every sequence, labels cut
    with their tokens) through the model; on the last stage the loss is the masked token
    cross entropy over ``normalizer`` (per-token loss: Megatron scales nothing, DDP sums
    over dp × cp). ``explicit_mask``: pass the causal mask (local attention) rather than
    None (TE attention, causal by its mask type)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.utils import get_batch_on_this_cp_rank

    def step(
        data: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        micro = get_batch_on_this_cp_rank(dict(next(data)), cp_group)
        tokens = micro["tokens"]
        mask = causal_inputs(tokens)[1] if explicit_mask else None
        output = model(tokens, micro["position_ids"], mask)

        def loss(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            per_token = vocab_parallel_cross_entropy(logits.float(), micro["labels"])
            total = (per_token * micro["loss_mask"]).sum() / normalizer
            count = micro["loss_mask"].sum().to(torch.int)
            return total, count, {"loss": total.detach()}

        return output, loss

    return step


def forward_backward(
    spec: LayoutSpec,
    groups: LayoutGroups,
    ddps: Sequence[Any],
    batch: Sequence[TrainSample],
    *,
    explicit_mask: bool,
    force_all_reduce: bool = False,
) -> float | None:
    """One step's forward and backward passes through Megatron's schedule for ``spec``
    (no pipelining, or interleaved 1F1B over the chunks ``ddps``), gradients reduced
    (``force_all_reduce``: all-reduced even under the distributed optimizer, so that
    every rank holds them whole). The batch loss on the last pipeline stage, summed over
    CP ranks; None on other stages. Collective over the layout."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    install_parallel_state(groups)  # the vocab-parallel cross entropy reads the TP group
    for ddp in ddps:
        ddp.zero_grad_buffer()
    micros, normalizer = micro_batches(batch)
    cp = groups.groups["cp"].pg
    vpp = spec.virtual_pipeline if spec.vpp > 1 else None
    run = get_forward_backward_func(pp_size=spec.pp, vp_size=vpp)
    store = run(
        forward_step_func=forward_step_func(normalizer, cp, explicit_mask),
        data_iterator=[iter(micros) for _ in ddps] if vpp else iter(micros),
        model=list(ddps) if vpp else ddps[0],
        num_microbatches=len(micros),
        seq_length=SEQ,
        micro_batch_size=MICRO,
        p2p_communicator=P2PCommunicator(pp_group=groups.groups["pp"].pg, config=ddps[0].config),
        pg_collection=pg_collection(groups),
    )
    for ddp in ddps:
        ddp.finish_grad_sync(force_all_reduce=force_all_reduce)
    if not store:
        return None
    loss = torch.stack([item["loss"] for item in store]).sum()
    if spec.cp > 1:
        dist.all_reduce(loss, group=cp)
    return float(loss)


def gather(
    layout: Layout,
    local: Mapping[str, torch.Tensor],
    *,
    rank: int,
    root: int,
    group: CommGroup,
    names: Collection[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Full tensors of ``layout`` (``names``, default all) assembled on ``root`` from each
    rank's local tensors ``local`` by the layout's placements, with dynarl's planner and
    executor (checksummed); ``{}`` on other ranks. Collective over ``group``."""
    tensors = {n: t for n, t in layout.tensor_map().items() if names is None or n in names}
    full = [Shard(tensor=n, rank=root, region=t.full()) for n, t in tensors.items()]
    out = {}
    if rank == root:
        out = {
            n: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=DEVICE)
            for n, t in tensors.items()
        }
    plan = plan_reshard(
        tensors, [p.shard for p in layout.placements if p.shard.tensor in tensors], full
    )
    report = execute_plan(
        plan,
        rank=rank,
        group=group,
        sources={
            p.shard: p.view(local[p.shard.tensor])
            for p in layout.placements_on(rank)
            if p.shard.tensor in tensors
        },
        destinations={s: out[s.tensor] for s in full} if rank == root else {},
        config=ExecutorConfig(),
    )
    assert report.verified, f"gather checksums differ: {report.mismatched[:3]}"
    return out


def bitwise_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def relative_l2(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """``|a - b| / |b|`` over all tensors (one L2 norm), in float64."""
    num = sum(float((a[n].double() - b[n].double()).square().sum()) for n in b)
    den = sum(float(b[n].double().square().sum()) for n in b)
    return math.sqrt(num / den)


# ---------------------------------------------------------------------- context parallel
