"""The reference trainer (one rank) and the log-prob worker."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from dynarl.backends._grpo import TrainSample
from dynarl.backends.reference import (
    GPTConfig,
    GRPOConfig,
    LogProbWorker,
    TrainConfig,
    Trainer,
    solo_process_group,
)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread, the runtime's device model (and much faster on a busy box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


MODEL = GPTConfig(hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, max_seq_len=64)


@pytest.fixture(scope="module")
def group() -> Iterator[dist.ProcessGroup]:
    with solo_process_group() as g:
        yield g


def _batch(seed: int, n: int = 8) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(8, 24)
        tokens = tuple(rng.randrange(3, MODEL.vocab_size) for _ in range(length))
        mask = tuple(t >= 4 for t in range(length - 1))
        out.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=1.0 if i % 2 else -1.0))
    return out


def _trainer(group: dist.ProcessGroup, **overrides: object) -> Trainer:
    options: dict[str, object] = {"lr": 1e-3, "micro_batch_size": 3}
    options.update(overrides)
    config = TrainConfig(**options)  # type: ignore[arg-type]
    return Trainer(MODEL, config, tp_group=group, dp_group=group)


def _sequence_logp(trainer: Trainer, sample: TrainSample) -> float:
    with torch.no_grad():
        logp = trainer.model.token_logprobs(torch.tensor([sample.tokens]))[0]
    return float((logp * torch.tensor(sample.loss_mask, dtype=torch.float32)).sum())


def test_grpo_step_moves_probability_toward_positive_advantages(
    group: dist.ProcessGroup,
) -> None:
    trainer = _trainer(group)
    batch = _batch(0)
    before = [_sequence_logp(trainer, s) for s in batch]
    stats = trainer.train_step(batch)
    after = [_sequence_logp(trainer, s) for s in batch]
    assert stats.version == trainer.version == 1 and stats.num_samples == 8
    assert stats.num_tokens == sum(sum(s.loss_mask) for s in batch) and stats.grad_norm > 0
    for sample, b, a in zip(batch, before, after, strict=True):
        assert (a > b) == (sample.advantage > 0)


def test_restart_from_full_state_continues_bit_for_bit(group: dist.ProcessGroup) -> None:
    first = _trainer(group)
    for seed in (1, 2):
        first.train_step(_batch(seed))
    checkpoint = first.full_state()
    second = _trainer(group)
    assert second.state_checksum() != first.state_checksum()
    second.load_full_state(checkpoint)
    assert second.state_checksum() == first.state_checksum()
    for trainer in (first, second):
        trainer.train_step(_batch(3))
    assert second.state_checksum() == first.state_checksum()
    assert second.version == first.version == 3
    assert all(
        torch.equal(a, b)
        for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True)
    )


def test_micro_batch_size_changes_only_rounding(group: dist.ProcessGroup) -> None:
    coarse, fine = _trainer(group, micro_batch_size=8), _trainer(group, micro_batch_size=1)
    fast = _trainer(group, micro_batch_size=3, deterministic=False)
    for trainer in (coarse, fine, fast):
        trainer.train_step(_batch(4))
    for other in (fine, fast):
        for a, b in zip(coarse.model.parameters(), other.model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_sft_steps_reduce_the_loss(group: dist.ProcessGroup) -> None:
    trainer = _trainer(group, lr=3e-3)
    batch = _batch(5)
    losses = [trainer.sft_step(batch).loss for _ in range(12)]
    # Random tokens: only memorisation lowers the loss, steadily.
    assert losses[-1] < 0.75 * losses[0]
    assert losses[-1] < losses[len(losses) // 2] < losses[0]


def test_logprob_worker_scores_like_the_trainer(group: dist.ProcessGroup) -> None:
    trainer = _trainer(group)
    trainer.train_step(_batch(6))
    worker = LogProbWorker(MODEL, tp_group=group, micro_batch_size=3)
    with pytest.raises(ValueError, match="before load_weights"):
        worker.compute([(1, 2, 3)])
    worker.load_weights(trainer.model.full_state_dict(), trainer.version)
    samples = _batch(7)
    scored = worker.compute([s.tokens for s in samples])
    for sample, logps in zip(samples, scored, strict=True):
        assert len(logps) == len(sample.tokens) - 1
        with torch.no_grad():
            expected = trainer.model.token_logprobs(torch.tensor([sample.tokens]))[0]
        torch.testing.assert_close(torch.tensor(logps), expected, rtol=0, atol=1e-5)


def test_validation(group: dist.ProcessGroup) -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        TrainSample(tokens=(1, 2, 3), loss_mask=(True,))
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainConfig(micro_batch_size=0)
    trainer = _trainer(group, grpo=GRPOConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_logprobs"):
        trainer.train_step(_batch(0))
    with pytest.raises(ValueError, match="empty"):
        trainer.sft_step([])
