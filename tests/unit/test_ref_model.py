"""The reference GPT (Megatron TP layers) and the engine's batch-invariant decoder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dynarl.backends.reference import GPTConfig, solo_process_group
from dynarl.backends.reference._decoder import Decoder, DecoderRows
from dynarl.backends.reference._gpt import ParallelGPT, check_full_state, param_layout
from dynarl.backends.reference._kvcache import KVPool, KVPoolShape

CONFIG = GPTConfig(hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, max_seq_len=64)


@pytest.fixture(scope="module")
def model() -> Iterator[ParallelGPT]:
    with solo_process_group() as group:
        yield ParallelGPT(CONFIG, tp_group=group)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pool(slots: int = 4) -> KVPool:
    return KVPool(
        KVPoolShape(
            num_layers=CONFIG.num_layers,
            num_slots=slots,
            num_heads=CONFIG.num_heads,
            head_dim=CONFIG.head_dim,
            max_seq_len=CONFIG.max_seq_len,
        )
    )


def _rows(tokens: list[int], start: int, slot: int, logits_for: list[int]) -> DecoderRows:
    n = len(tokens)
    return DecoderRows(
        tokens=torch.tensor(tokens),
        positions=torch.arange(start, start + n),
        slots=torch.full((n,), slot),
        logit_rows=torch.tensor(logits_for),
    )


def test_layout_matches_parameters_and_init_is_seeded(model: ParallelGPT) -> None:
    layout = param_layout(CONFIG)
    params = dict(model.named_parameters())
    assert [shard.name for shard in layout] == list(params)
    assert all(tuple(params[s.name].shape) == s.full_shape for s in layout)
    state = model.full_state_dict()
    check_full_state(CONFIG, state)
    with pytest.raises(ValueError, match="shape"):
        check_full_state(CONFIG, {**state, "output.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="missing"):
        check_full_state(CONFIG, {k: v for k, v in state.items() if k != "position.weight"})


def test_forward_is_causal_and_logprobs_are_log_softmax(model: ParallelGPT) -> None:
    tokens = torch.randint(
        3, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    logits = model(tokens)
    assert logits.shape == (2, 12, CONFIG.vocab_size)
    changed = tokens.clone()
    changed[:, 8:] = 5
    assert torch.equal(model(changed)[:, :8], logits[:, :8])
    logp = model.token_logprobs(tokens)
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(logp, expected)


def test_full_state_round_trip(model: ParallelGPT) -> None:
    state = model.full_state_dict()
    noisy = {k: v + 0.5 for k, v in state.items()}
    model.load_full_state_dict(noisy)
    assert torch.equal(model.full_state_dict()["layers.1.fc2.weight"], noisy["layers.1.fc2.weight"])
    model.load_full_state_dict(state)
    assert all(torch.equal(model.full_state_dict()[k], v) for k, v in state.items())


@pytest.mark.parametrize("deterministic", [True, False])
def test_decoder_matches_the_trainer_model(
    model: ParallelGPT, deterministic: bool, one_thread: None
) -> None:
    tokens = torch.randint(
        3, CONFIG.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1)
    )
    expected = model(tokens)[0]
    decoder = Decoder(CONFIG, deterministic=deterministic)
    decoder.load(model.full_state_dict())
    pool = _pool()
    slot = pool.allocate()
    got = decoder.forward(pool, _rows(tokens[0].tolist(), 0, slot, list(range(30))))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def _incremental(decoder: Decoder, tokens: list[int], split: int, noise: bool) -> torch.Tensor:
    """Logits of every position: prefill ``tokens[:split]``, then one token per call,
    optionally sharing each call with rows of an unrelated sequence."""
    pool = _pool()
    slot, other = pool.allocate(), pool.allocate()
    out = [decoder.forward(pool, _rows(tokens[:split], 0, slot, list(range(split))))]
    for pos in range(split, len(tokens)):
        rows = _rows([tokens[pos]], pos, slot, [0])
        if noise:
            extra = (pos % 4) + 1
            rows = DecoderRows(
                tokens=torch.cat([rows.tokens, torch.full((extra,), 7)]),
                positions=torch.cat([rows.positions, torch.arange(pos, pos + extra)]),
                slots=torch.cat([rows.slots, torch.full((extra,), other)]),
                logit_rows=torch.tensor([0]),
            )
        out.append(decoder.forward(pool, rows))
    return torch.cat(out)


def test_deterministic_decoder_is_batch_invariant(model: ParallelGPT, one_thread: None) -> None:
    tokens = torch.randint(3, CONFIG.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    decoder = Decoder(CONFIG, deterministic=True)
    decoder.load(model.full_state_dict())
    reference = _incremental(decoder, tokens.tolist(), 40, noise=False)
    for split, noise in [(1, False), (17, False), (1, True), (29, True)]:
        assert torch.equal(_incremental(decoder, tokens.tolist(), split, noise), reference)


def test_fast_decoder_agrees_within_tolerance(model: ParallelGPT) -> None:
    tokens = torch.randint(3, CONFIG.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    decoder = Decoder(CONFIG, deterministic=False)
    decoder.load(model.full_state_dict())
    reference = _incremental(decoder, tokens.tolist(), 40, noise=False)
    torch.testing.assert_close(
        _incremental(decoder, tokens.tolist(), 3, noise=True), reference, rtol=0, atol=1e-5
    )


def test_kv_pool_slots_are_zeroed_and_accounted() -> None:
    pool = _pool(slots=2)
    a = pool.allocate()
    pool.keys[:, a] = 1.0
    pool.release(a)
    assert pool.allocate() == a and float(pool.keys[:, a].abs().sum()) == 0.0
    pool.allocate()
    assert pool.num_free == 0
    with pytest.raises(Exception, match="no free slot"):
        pool.allocate()
    with pytest.raises(ValueError, match="not allocated"):
        pool.release(7)
