"""Streamed GRPO steps: gradient rows kept as micro-batches complete, summed in a fixed order.

A step learned from micro-batches in any arrival order is bitwise the step learned in
micro-batch order; a missing or repeated micro-batch is refused. Token weight versions
survive their run-length text form.
"""

from __future__ import annotations

import pytest
import torch

from dynarl.backends._grpo import TrainSample
from dynarl.backends.reference import GPTConfig, TrainConfig, Trainer, solo_process_group
from dynarl.backends.reference._accumulate import GradientBook
from dynarl.backends.reference._trainer import state_checksum
from dynarl.errors import BackendError
from dynarl.runtime._worker_protocol import decode_versions, encode_versions

MODEL = GPTConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=32)


def micro(seed: int) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(3):
        tokens = tuple(int(t) for t in torch.randint(3, 32, (10 + i,), generator=gen))
        mask = (False,) * 4 + (True,) * (len(tokens) - 5)
        out.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=float(i - 1)))
    return out


def streamed_step(order: list[int]) -> str:
    torch.manual_seed(0)
    with solo_process_group() as group:
        trainer = Trainer(MODEL, TrainConfig(), tp_group=group, dp_group=group)
        book = GradientBook(trainer.row_size)
        for index in order:
            book.add(index, trainer.micro_gradient(micro(index), num_samples=12))
        total = book.total(4, group=None, deterministic=True)
        stats = trainer.apply_gradient(total, num_samples=12, num_tokens=0)
        assert stats.version == 1 and stats.grad_norm > 0
        return state_checksum(trainer.full_state())


def test_arrival_order_does_not_change_the_step() -> None:
    assert streamed_step([0, 1, 2, 3]) == streamed_step([2, 0, 3, 1])


def test_a_step_needs_every_micro_batch_once() -> None:
    book = GradientBook(4)
    book.add(0, torch.ones(4))
    with pytest.raises(ValueError, match="already"):
        book.add(0, torch.ones(4))
    with pytest.raises(ValueError, match="shape"):
        book.add(1, torch.ones(3))
    with pytest.raises(BackendError, match="missing"):
        book.total(2, group=None, deterministic=True)
    book.add(1, torch.full((4,), 2.0))
    assert torch.equal(book.total(2, group=None, deterministic=True), torch.full((4,), 3.0))


def test_token_versions_round_trip() -> None:
    versions = [3, 3, 4, 4, 4, 7]
    assert encode_versions(versions) == "3*2,4*3,7*1"
    assert decode_versions(encode_versions(versions)) == versions
    assert decode_versions("") == []
    with pytest.raises(ValueError):
        decode_versions("3-2")
