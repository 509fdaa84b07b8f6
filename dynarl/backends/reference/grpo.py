"""GRPO's math as pure functions: group-relative advantages and the policy-gradient loss.

* :func:`group_advantages`: for each group of samples drawn for one prompt,
  ``A_i = (r_i − mean(r)) / (std(r) + eps)`` (or without the division, as in Dr. GRPO).
* :func:`policy_loss`: the clipped surrogate of PPO on per-token log-probabilities,
  ``−min(r·A, clip(r, 1−ε, 1+ε)·A)`` with ``r = exp(logp − logp_old)``, plus an optional
  KL penalty to a reference policy (the k3 estimator ``exp(Δ) − Δ − 1``,
  ``Δ = logp_ref − logp``), summed over the tokens the model generated and divided by a
  normaliser given by the caller — the number of such tokens in the *global* batch — so
  that losses of micro-batches add up to the loss of the whole batch whatever the split.

No state, no process groups; run anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GRPOConfig", "PolicyLoss", "group_advantages", "kl_k3", "policy_loss"]


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
