"""The reference job's trainer is Megatron's: the reference architecture as a GPTModel.

The reference GPT (the engines', scorers' and hybrid replicas' model) and Megatron's
GPTModel under :func:`megatron_model` compute the same function from the same tensors,
renamed by :func:`to_megatron`; the trainer's KL reference scores like the reference
job's own scorer; the architecture is refused where an HF Llama map is needed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dynarl.backends._grpo import GRPOConfig, TrainSample
from dynarl.backends.megatron import MegatronTrainer, ReferencePolicy, hf_config
from dynarl.backends.megatron._gpt_model import causal_inputs
from dynarl.backends.reference import (
    GPTConfig,
    LogProbWorker,
    ParallelGPT,
    default_train,
    from_megatron,
    megatron_model,
    solo_process_group,
    to_megatron,
)
from dynarl.backends.reference._megatron_model import megatron_name

# Megatron on gloo leaves a listening socket in native code (see tests/conftest.py).
pytestmark = pytest.mark.gloo_listener_outlives_test

MODEL = GPTConfig(hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, max_seq_len=64)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def solo() -> Iterator[tuple[dist.ProcessGroup, Any]]:
    with solo_process_group() as group:
        yield group, dist.HashStore()  # type: ignore[attr-defined]


def trainer(store: Any, **train: Any) -> MegatronTrainer:
    out = MegatronTrainer(megatron_model(MODEL), default_train(**train), rank=0, store=store)
    out.start(out.layout_spec((0,)), epoch=0)
    return out


def batch(seed: int, n: int = 6) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(8, 24)
        tokens = tuple(rng.randrange(3, MODEL.vocab_size) for _ in range(length))
        mask = tuple(t >= 4 for t in range(length - 1))
        out.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=1.0 if i % 2 else -1.0))
    return out


def test_gptmodel_computes_the_reference_gpt_from_renamed_tensors(solo: Any) -> None:
    group, store = solo
    reference = ParallelGPT(MODEL, tp_group=group)
    state = reference.full_state_dict()
    megatron = trainer(store)
    try:
        megatron.load_full(to_megatron(state))
        back = from_megatron(megatron.gather(0), MODEL)
        assert list(back) == list(state)
        assert all(torch.equal(back[name], state[name]) for name in state)
        tokens = torch.randint(
            0, MODEL.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0)
        )
        module = megatron.module
        assert module is not None
        with torch.no_grad():
            ours = module(tokens, *causal_inputs(tokens)).float()
            theirs = reference(tokens)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    finally:
        megatron.close()


def test_the_scorer_agrees_with_the_trained_model_and_kl_uses_the_initial_weights(
    solo: Any,
) -> None:
    group, store = solo
    initial = ParallelGPT(MODEL, tp_group=group).full_state_dict()
    megatron = trainer(store, lr=1e-2, grpo=GRPOConfig(kl_coef=0.1))
    try:
        megatron.load_full(to_megatron(initial))
        policy = ReferencePolicy(megatron, to_megatron(initial))
        first = policy.score(batch(1))
        stats = megatron.train_step(first)
        assert stats.version == 1 and stats.kl == 0.0  # the policy still is the reference
        scorer = LogProbWorker(MODEL, tp_group=group, micro_batch_size=3)
        scorer.load_weights(initial, 0)
        samples = batch(2)
        expected = scorer.compute([s.tokens for s in samples])
        for got, want in zip(policy.logprobs(samples), expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)
        assert megatron.train_step(policy.score(samples)).kl > 0  # the trained one moved
        scorer.load_weights(from_megatron(megatron.gather(0), MODEL), megatron.version)
        trained = scorer.compute([s.tokens for s in samples])
        gap = max(
            abs(a - b)
            for row, ref in zip(trained, expected, strict=True)
            for a, b in zip(row, ref, strict=True)
        )
        assert gap > 1e-4
        with pytest.raises(ValueError, match="kl_coef"):
            megatron.train_step(samples)
        policy.close()
        with pytest.raises(ValueError, match="closed"):
            policy.logprobs(samples)
    finally:
        megatron.close()


def test_names_and_hf_refusals_are_clear() -> None:
    assert megatron_name("layers.1.qkv.bias") == "decoder.layers.1.self_attention.linear_qkv.bias"
    assert megatron_name("position.weight") == "embedding.position_embeddings.weight"
    for bad in ("layers.x.qkv.bias", "layers.0.attn.weight", "embedding"):
        with pytest.raises(ValueError, match="not a parameter"):
            megatron_name(bad)
    with pytest.raises(ValueError, match="lacks 'embedding"):
        from_megatron({}, MODEL)
    config = megatron_model(MODEL)
    assert config.hf_mismatches() == [
        "position_embedding='learned_absolute'",
        "normalization='LayerNorm'",
        "gated_mlp=False",
        "add_bias_linear=True",
    ]
    with pytest.raises(ValueError, match="no HF Llama"):
        hf_config(config)
    with pytest.raises(ValueError, match="no HF Llama"):
        config.hf_layout()
