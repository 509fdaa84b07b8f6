"""One training step's forward and backward passes through a Megatron GPT layout.

:func:`run_micro_batches` cuts the global batch into micro-batches of a fixed size (the cut
depends on the batch only), runs micro-batch j on data-parallel rank ``j mod dp`` and
returns the batch's loss, KL and clipped-token count, identical on every rank of the
layout. Gradients accumulate in Megatron DDP's ``main_grad`` buffers; the caller reduces
them (``finish_grad_sync``) and steps. With pipeline parallelism each micro-batch goes
through the stages in turn — activations forward and their gradients back over the
layout's pipeline group — one micro-batch at a time: correct, not overlapped.

Two layout flags shape the micro-batches (:func:`micro_tensors`). With sequence parallelism
every rank of a TP group holds a slice of the sequence, so tokens are right-padded to a
multiple of TP (padding is masked out of every loss), and the gradients of the parameters
that saw only a slice (norms, the MoE router) are summed over the TP group after the
backward pass (:func:`reduce_sequence_parallel_grads`). With expert parallelism the ranks
of an expert group — which span data-parallel ranks — exchange every MoE layer's tokens
(Megatron's allgather dispatcher gathers equal-sized inputs), so every data-parallel rank
runs the same number of micro-batches, all of one shape: the batch must split evenly and
every sequence is padded to the batch's longest.

The losses (:func:`grpo_loss`, :func:`sft_loss`) are the reference backend's GRPO math
(:mod:`dynarl.backends._grpo`) on log-probs from Megatron's vocab-parallel cross
entropy. Runs on each trainer rank, inside a training step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dynarl.backends._grpo import TrainSample, pad_samples, per_target, policy_loss
from dynarl.backends.megatron._gpt_model import causal_inputs, token_logprobs
from dynarl.backends.megatron._train_config import MegatronTrainConfig
from dynarl.migrate import LayoutGroups, LayoutSpec

__all__ = [
    "LossFn",
    "grpo_loss",
    "logprob_gap",
    "micro_tensors",
    "reduce_sequence_parallel_grads",
    "run_micro_batches",
    "sft_loss",
]

LossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Sequence[TrainSample], float],
    tuple[torch.Tensor, torch.Tensor],
]
"""``(logits, tokens, loss mask, micro-batch, normaliser) -> (loss, [loss, kl, clipped])``."""


def grpo_loss(config: MegatronTrainConfig) -> LossFn:
    """The GRPO loss of a micro-batch under ``config`` (temperature, clip, KL weight)."""

    def loss(
        logits: torch.Tensor,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        micro: Sequence[TrainSample],
        normalizer: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logp = token_logprobs(logits, tokens, config.temperature)
        old = per_target(micro, "old_logprobs", logp.detach())
        ref = per_target(micro, "ref_logprobs", logp.detach())
        advantages = torch.tensor([s.advantage for s in micro], device=logp.device)
        out = policy_loss(
            logp, old, advantages, mask,
            config=config.grpo, normalizer=normalizer, ref_logprobs=ref,
        )  # fmt: skip
        return out.loss, torch.stack([out.loss.detach(), out.kl.to(logp.device), out.clipped])

    return loss


def sft_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    micro: Sequence[TrainSample],
    normalizer: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy on the ``loss_mask`` tokens, over the global normaliser."""
    loss = -(token_logprobs(logits, tokens, 1.0) * mask).sum() / normalizer
    zero = torch.zeros((), device=loss.device)
    return loss, torch.stack([loss.detach(), zero, zero])


def micro_tensors(
    micro: Sequence[TrainSample], spec: LayoutSpec, *, device: torch.device, length: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``(b, L)`` and loss mask ``(b, L - 1)`` of ``micro`` on ``device``,
    right-padded to at least ``length`` tokens and, under sequence parallelism, to a
    multiple of TP (padding is masked)."""
    tokens, mask = pad_samples(micro)
    multiple = spec.tp if spec.sequence_parallel else 1
    target = -(-max(length, tokens.shape[1]) // multiple) * multiple
    extra = target - tokens.shape[1]
    if extra:
        tokens = torch.nn.functional.pad(tokens, (0, extra))
        mask = torch.nn.functional.pad(mask, (0, extra))
    return tokens.to(device), mask.to(device)


def reduce_sequence_parallel_grads(spec: LayoutSpec, groups: LayoutGroups, ddp: Any) -> None:
    """Under sequence parallelism, sum the reduced gradients (``main_grad``) of the
    parameters marked ``sequence_parallel`` over the TP group, as Megatron's
    ``finalize_model_grads`` does after its data-parallel reduction (collective over the
    TP group); nothing otherwise."""
    if not spec.sequence_parallel:
        return
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    _allreduce_non_tensor_model_parallel_grads([ddp], ddp.config, groups.groups["tp"].pg)


def logprob_gap(
    module: torch.nn.Module,
    samples: Sequence[TrainSample],
    spec: LayoutSpec,
    temperature: float,
    device: torch.device,
) -> float:
    """The largest ``|log p - old|`` over the policy tokens of ``samples`` (each with
    ``old_logprobs``: what the rollout engine reported), ``log p`` teacher-forced by
    ``module`` (a whole model: one pipeline stage) at the sampling ``temperature`` — how far
    the engine's numbers are from the trainer's. Collective over the installed
    tensor-parallel group only; no gradient. Raises ValueError on a sample without
    ``old_logprobs``."""
    if not samples or any(s.old_logprobs is None for s in samples):
        raise ValueError("logprob_gap needs samples with old_logprobs")
    tokens, mask = micro_tensors(samples, spec, device=device)
    with torch.no_grad():
        logits = module(tokens, *causal_inputs(tokens))
        logp = token_logprobs(logits, tokens, temperature)
    old = per_target(samples, "old_logprobs", torch.zeros_like(logp))
    gap = (logp - old).abs() * mask
    return float(gap.max()) if gap.numel() else 0.0


def run_micro_batches(
    spec: LayoutSpec,
    groups: LayoutGroups,
    module: torch.nn.Module,
    ddp: torch.nn.Module,
    samples: Sequence[TrainSample],
    *,
    loss_fn: LossFn,
    rank: int,
    micro_batch_size: int,
    normalizer: float,
    device: torch.device,
) -> torch.Tensor:
    """Forward and backward this rank's micro-batches; ``[loss, kl, clipped]`` of the whole
    batch (collective over the data-parallel and pipeline groups, and the expert groups).
    Raises ValueError, with expert parallelism, for a batch that does not split into
    micro-batches of ``micro_batch_size``, the same number on every data-parallel rank."""
    _, dp_rank, _ = spec.coords(rank)
    micros = [samples[i : i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]
    length = 0
    if spec.ep > 1:
        if len(samples) % (micro_batch_size * spec.dp):
            raise ValueError(
                f"expert_parallel: {len(samples)} samples do not split into micro-batches of "
                f"micro_batch_size={micro_batch_size} on each of dp={spec.dp} ranks evenly"
            )
        length = max(len(sample.tokens) for sample in samples)
    total = torch.zeros(3, dtype=torch.float32, device=device)
    for micro in micros[dp_rank :: spec.dp]:
        tokens, mask = micro_tensors(micro, spec, device=device, length=length)
        if spec.pp == 1:
            logits = ddp(tokens, *causal_inputs(tokens))
            loss, scalars = loss_fn(logits, tokens, mask, micro, normalizer)
            torch.autograd.backward(loss)
        else:
            scalars = _pipeline_micro(
                groups, module, ddp, tokens, mask, micro, loss_fn, normalizer, rank=rank
            )
        total += scalars.float()
    dist.all_reduce(total, group=groups.groups["dp"].pg)
    pipeline = groups.groups["pp"]
    if len(pipeline.ranks) > 1:
        dist.broadcast(total, group=pipeline.pg, group_src=len(pipeline.ranks) - 1)
    return total


def _pipeline_micro(
    groups: LayoutGroups,
    module: torch.nn.Module,
    ddp: torch.nn.Module,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    micro: Sequence[TrainSample],
    loss_fn: LossFn,
    normalizer: float,
    *,
    rank: int,
) -> torch.Tensor:
    """One micro-batch through this rank's stage: receive the activations, forward, send
    them on; backward from the next stage's gradient (or the loss on the last stage) and
    send the input's gradient back. Returns the scalars (zeros before the last stage)."""
    pipeline = groups.groups["pp"]
    stage = pipeline.ranks.index(rank)
    last = stage == len(pipeline.ranks) - 1
    config: Any = module.config
    # Under sequence parallelism a stage hands on this rank's slice of the sequence.
    split = groups.spec.tp if groups.spec.sequence_parallel else 1
    shape = (tokens.shape[1] // split, tokens.shape[0], int(config.hidden_size))
    dtype: torch.dtype = config.pipeline_dtype
    hidden_in = None
    if stage > 0:
        hidden_in = torch.empty(shape, dtype=dtype, device=tokens.device)
        dist.recv(hidden_in, group=pipeline.pg, group_src=stage - 1)
        hidden_in.requires_grad_()
        module.set_input_tensor(hidden_in)  # type: ignore[operator]
    out = ddp(tokens if stage == 0 else None, *causal_inputs(tokens))
    if last:
        loss, scalars = loss_fn(out, tokens, mask, micro, normalizer)
        torch.autograd.backward(loss)
    else:
        dist.send(out.detach().contiguous(), group=pipeline.pg, group_dst=stage + 1)
        grad = torch.empty(shape, dtype=dtype, device=tokens.device)
        dist.recv(grad, group=pipeline.pg, group_src=stage + 1)
        torch.autograd.backward(out, grad)
        scalars = torch.zeros(3, device=tokens.device)
    if hidden_in is not None:
        assert hidden_in.grad is not None
        dist.send(hidden_in.grad.contiguous(), group=pipeline.pg, group_dst=stage - 1)
    return scalars
