"""GRPO's math as pure functions: group-relative advantages and the policy-gradient loss.

* :func:`group_advantages`: for each group of samples drawn for one prompt,
  ``A_i = (r_i − mean(r)) / (std(r) + eps)`` (or without the division, as in Dr. GRPO).
* :func:`policy_loss`: the clipped surrogate of PPO on per-token log-probabilities,
  ``−min(r·A, clip(r, 1−ε, 1+ε)·A)`` with ``r = exp(logp − logp_old)``, plus an optional
  KL penalty to a reference policy (the k3 estimator ``exp(Δ) − Δ − 1``,
  ``Δ = logp_ref − logp``), summed over the tokens the model generated and divided by a
  normaliser given by the caller — the number of such tokens in the *global* batch — so
  that losses of micro-batches add up to the loss of the whole batch whatever the split.

:class:`TrainSample` is the unit both consume (tokens, which of them the policy wrote, the
advantage, the log-probs to compare with); :func:`pad_samples` and :func:`per_target`
turn a micro-batch of them into tensors. No state, no process groups; run anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "GRPOConfig",
    "PolicyLoss",
    "StepStats",
    "TrainSample",
    "group_advantages",
    "kl_k3",
    "pad_samples",
    "per_target",
    "policy_loss",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    """Loss settings of GRPO."""

    clip_eps: float = 0.2
    """PPO clip range ε of the probability ratio."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (0: no reference needed)."""
    normalize_std: bool = True
    """Divide advantages by the group's reward standard deviation."""
    adv_eps: float = 1e-6
    """Added to the standard deviation before dividing."""

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"GRPOConfig.clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.kl_coef < 0:
            raise ValueError(f"GRPOConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.adv_eps <= 0:
            raise ValueError(f"GRPOConfig.adv_eps must be > 0, got {self.adv_eps}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSample:
    """One sequence to train on. Per-target arrays have ``len(tokens) − 1`` entries:
    entry t is about predicting ``tokens[t + 1]``."""

    tokens: tuple[int, ...]
    """Prompt and response (tool results included)."""
    loss_mask: tuple[bool, ...]
    """Per target: True where the policy generated that token."""
    advantage: float = 0.0
    """The sequence's advantage (GRPO)."""
    old_logprobs: tuple[float, ...] | None = None
    """Per target: log-probs the ratio is taken against (None: the current policy's)."""
    ref_logprobs: tuple[float, ...] | None = None
    """Per target: reference-policy log-probs for the KL penalty."""

    def __post_init__(self) -> None:
        n = len(self.tokens) - 1
        if n < 1:
            raise ValueError("TrainSample.tokens needs at least two tokens")
        for name in ("loss_mask", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"TrainSample.{name} has {len(value)} entries, expected {n}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLoss:
    """The loss of one (micro-)batch and its parts, each already divided by the normaliser."""

    loss: torch.Tensor
    """Scalar to differentiate: ``pg + kl_coef · kl``."""
    pg: torch.Tensor
    """Clipped surrogate part (scalar, detached)."""
    kl: torch.Tensor
    """KL part before weighting (scalar, detached; 0 without a reference)."""
    clipped: torch.Tensor
    """Number of tokens whose ratio was clipped (scalar, detached)."""


def group_advantages(
    rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages of ``rewards`` shaped ``(groups, samples per group)``.

    A group whose rewards are all equal gets zero advantages. Raises ValueError unless
    ``rewards`` is 2-D with at least one sample per group.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards must be (groups, group_size), got {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std and rewards.shape[1] > 1:
        centered = centered / (rewards.std(dim=1, keepdim=True) + eps)
    return centered.to(torch.float32)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π ‖ π_ref): ``exp(Δ) − Δ − 1``, ``Δ = ref − logp`` (≥ 0)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: GRPOConfig,
    normalizer: float,
    ref_logprobs: torch.Tensor | None = None,
) -> PolicyLoss:
    """The GRPO loss of a batch of sequences.

    ``logprobs`` (differentiable), ``old_logprobs``, ``mask`` and ``ref_logprobs`` are
    ``(batch, tokens)``; ``advantages`` is ``(batch,)`` (one per sequence). ``mask`` is 1
    on tokens the policy generated. Raises ValueError on mismatched shapes, a
    non-positive normaliser, or a KL weight without reference log-probs.
    """
    if not logprobs.shape == old_logprobs.shape == mask.shape:
        raise ValueError("logprobs, old_logprobs and mask must have the same shape")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError("advantages must have one value per sequence")
    if normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = ratio.clamp(1.0 - config.clip_eps, 1.0 + config.clip_eps)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    pg = -(surrogate * mask).sum() / normalizer
    was_clipped = ((ratio * adv) > (clipped_ratio * adv)).to(logprobs.dtype)
    if ref_logprobs is not None and config.kl_coef > 0:
        kl = (kl_k3(logprobs, ref_logprobs) * mask).sum() / normalizer
    else:
        kl = torch.zeros((), dtype=logprobs.dtype)
    return PolicyLoss(
        loss=pg + config.kl_coef * kl,
        pg=pg.detach(),
        kl=kl.detach(),
        clipped=(was_clipped * mask).sum().detach(),
    )


def pad_samples(micro: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens ``(b, L)`` and float loss mask ``(b, L − 1)`` of ``micro``."""
    length = max(len(sample.tokens) for sample in micro)
    tokens = torch.zeros(len(micro), length, dtype=torch.long)
    mask = torch.zeros(len(micro), length - 1)
    for i, sample in enumerate(micro):
        tokens[i, : len(sample.tokens)] = torch.tensor(sample.tokens)
        mask[i, : len(sample.loss_mask)] = torch.tensor(sample.loss_mask, dtype=torch.float32)
    return tokens, mask


def per_target(micro: Sequence[TrainSample], name: str, default: torch.Tensor) -> torch.Tensor:
    """``default`` with each sample's per-target field ``name`` written over its row."""
    out = default.clone()
    for i, sample in enumerate(micro):
        values = getattr(sample, name)
        if values is not None:
            out[i, : len(values)] = torch.tensor(values, dtype=out.dtype)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    """What one optimizer step did (identical on every rank)."""

    version: int
    """Weight version after the step."""
    loss: float
    """Loss of the global batch."""
    kl: float
    """KL term (GRPO with a reference; 0 otherwise)."""
    clip_fraction: float
    """Fraction of policy tokens whose ratio was clipped."""
    num_tokens: int
    """Policy tokens in the batch."""
    num_samples: int
    """Sequences in the batch."""
    grad_norm: float
    """L2 norm of the full gradient (before clipping)."""
