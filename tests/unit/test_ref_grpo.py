"""GRPO's pure functions: group-relative advantages, the clipped loss, the KL estimate."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dynarl.backends._grpo import group_advantages, kl_k3, policy_loss
from dynarl.backends.reference import GRPOConfig


@given(
    st.lists(
        st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2, max_size=8),
        min_size=1,
        max_size=6,
    ).filter(lambda groups: len({len(g) for g in groups}) == 1)
)
def test_advantages_are_centred_and_scaled_per_group(groups: list[list[float]]) -> None:
    rewards = torch.tensor(groups)
    adv = group_advantages(rewards)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(len(groups)), atol=1e-5)
    for row, r in zip(adv, rewards, strict=True):
        if float(r.std()) == 0:
            assert torch.equal(row, torch.zeros_like(row))
        else:
            assert torch.isclose(row.std(), torch.tensor(1.0), atol=1e-4)
            assert torch.equal(row.argsort(stable=True), r.argsort(stable=True))
    unscaled = group_advantages(rewards, normalize_std=False)
    assert torch.allclose(unscaled, rewards - rewards.mean(dim=1, keepdim=True))


def test_advantages_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match="groups"):
        group_advantages(torch.zeros(4))


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=gen)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=gen)
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float32)
    return logp, old, adv, mask


def test_on_policy_gradient_raises_good_tokens_and_lowers_bad_ones() -> None:
    logp, _, adv, mask = _inputs()
    out = policy_loss(logp, logp.detach(), adv, mask, config=GRPOConfig(), normalizer=13.0)
    torch.autograd.backward(out.loss)
    assert logp.grad is not None
    # d loss / d logp = −A / N on policy tokens, 0 elsewhere.
    expected = -(adv[:, None] * mask) / 13.0
    torch.testing.assert_close(logp.grad, expected)
    assert float(out.clipped) == 0.0


def test_clipping_stops_the_gradient_outside_the_trust_region() -> None:
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, 1.0]])  # ratios e and 1/e
    for advantage, grad_alive in [(1.0, [False, True]), (-1.0, [True, False])]:
        logp.grad = None
        out = policy_loss(
            logp, old, torch.tensor([advantage]), torch.ones(1, 2),
            config=GRPOConfig(clip_eps=0.2), normalizer=2.0,
        )  # fmt: skip
        torch.autograd.backward(out.loss)
        assert logp.grad is not None
        assert [bool(g != 0) for g in logp.grad[0]] == grad_alive
        assert float(out.clipped) == 1.0


def test_micro_batch_losses_add_up_to_the_batch_loss() -> None:
    logp, old, adv, mask = _inputs()
    config = GRPOConfig(kl_coef=0.1)
    ref = old - 0.1
    total = policy_loss(logp, old, adv, mask, config=config, normalizer=13.0, ref_logprobs=ref)
    parts = 0.0
    for i in range(3):
        part = policy_loss(
            logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1],
            config=config, normalizer=13.0, ref_logprobs=ref[i : i + 1],
        )  # fmt: skip
        parts += float(part.loss.detach())
    assert abs(float(total.loss.detach()) - parts) < 1e-6
    assert float(total.kl) > 0


def test_kl_k3_is_nonnegative_and_zero_at_equality() -> None:
    a = torch.linspace(-3, 0, 50)
    assert torch.equal(kl_k3(a, a), torch.zeros(50))
    assert bool((kl_k3(a, a.flip(0)) >= 0).all())


def test_policy_loss_validates_inputs() -> None:
    logp, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, adv, mask, config=GRPOConfig(kl_coef=0.1), normalizer=1.0)
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(logp, old, adv, mask, config=GRPOConfig(), normalizer=0.0)
    with pytest.raises(ValueError, match="one value per sequence"):
        policy_loss(logp, old, adv[:2], mask, config=GRPOConfig(), normalizer=1.0)
    with pytest.raises(ValueError, match="clip_eps"):
        GRPOConfig(clip_eps=1.5)
