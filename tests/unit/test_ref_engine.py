"""The reference rollout engine: batching, KV and prefix caches, abort, determinism."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from dynarl.backends.reference import EngineConfig, GPTConfig, RolloutEngine, solo_process_group
from dynarl.backends.reference._gpt import ParallelGPT
from dynarl.backends.reference._prefix_cache import PrefixCache
from dynarl.backends.reference._request import (
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    PendingRequest,
)
from dynarl.backends.reference._sampling import sample_tokens, sampling_uniform

MODEL = GPTConfig(hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, max_seq_len=96)
STOP = 2


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    with solo_process_group() as group:
        return ParallelGPT(MODEL, tp_group=group).full_state_dict()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine(weights: dict[str, torch.Tensor], **overrides: object) -> RolloutEngine:
    options: dict[str, object] = {"max_seq_len": 64, "deterministic": True}
    options.update(overrides)
    engine = RolloutEngine(MODEL, EngineConfig(**options))  # type: ignore[arg-type]
    engine.load_weights(weights, version=0)
    return engine


def _requests(n: int = 24) -> list[GenerationRequest]:
    shared = (1, 10, 11, 12, 13, 14, 15)
    return [
        GenerationRequest(
            sample_id=100 + i,
            prompt=shared + tuple(20 + j for j in range(i % 5)),
            max_new_tokens=40,
            seed=9,
            stop_tokens=(STOP,),
        )
        for i in range(n)
    ]


def _signature(outputs: list[GenerationOutput]) -> dict[int, tuple[object, ...]]:
    return {o.sample_id: (o.tokens, o.logprobs, o.versions, o.finish_reason) for o in outputs}


def _run(engine: RolloutEngine, requests: list[GenerationRequest]) -> dict[int, tuple[object, ...]]:
    for request in requests:
        engine.submit(request)
    return _signature(engine.run_until_idle(max_steps=10_000))


def test_generates_with_limits_logprobs_and_versions(weights: dict[str, torch.Tensor]) -> None:
    engine = _engine(weights)
    assert engine.run_until_idle() == []
    result = _run(engine, _requests(8))
    assert len(result) == 8
    for tokens, logprobs, versions, reason in result.values():
        assert isinstance(tokens, tuple) and 1 <= len(tokens) <= 40
        assert isinstance(logprobs, tuple) and len(logprobs) == len(tokens)
        assert all(lp <= 0 for lp in logprobs)
        assert versions == (0,) * len(tokens)
        assert (reason is FinishReason.STOP) == (tokens[-1] == STOP)
        assert STOP not in tokens[:-1]
    stats = engine.stats()
    assert stats.generated_tokens == sum(len(v[0]) for v in result.values())  # type: ignore[arg-type]
    assert stats.num_running == 0 and stats.utilization == 0.0


def test_deterministic_results_do_not_depend_on_batching_caching_or_order(
    weights: dict[str, torch.Tensor],
) -> None:
    requests = _requests()
    baseline_engine = _engine(weights, num_slots=32)
    baseline = _run(baseline_engine, requests)
    variants = {
        "one slot, no prefix cache": _engine(weights, num_slots=1, prefix_cache_tokens=0),
        "tight KV (retractions)": _engine(weights, num_slots=6, kv_capacity_tokens=64),
        "small prefill budget": _engine(weights, num_slots=5, max_step_tokens=8),
    }
    for name, engine in variants.items():
        assert _run(engine, requests[::-1]) == baseline, name
    assert variants["tight KV (retractions)"].stats().num_retracted > 0
    assert variants["one slot, no prefix cache"].stats().prefix_hit_tokens == 0
    assert variants["small prefill budget"].stats().prefix_hit_tokens > 0


def test_abort_returns_partial_output_that_resumes_identically(
    weights: dict[str, torch.Tensor],
) -> None:
    request = GenerationRequest(sample_id=7, prompt=(1, 5, 6, 7), max_new_tokens=30, seed=3)
    uninterrupted = _run(_engine(weights), [request])[7]
    engine = _engine(weights)
    engine.submit(request)
    for _ in range(6):
        engine.step()
    partial = engine.abort(7)
    assert partial is not None and partial.finish_reason is FinishReason.ABORT
    assert len(partial.tokens) == 6 == len(partial.logprobs) == len(partial.versions)
    assert engine.abort(7) is None and not engine.has_work
    elsewhere = _engine(weights, num_slots=3)
    resumed = _run(elsewhere, [partial.resume_request()])[7]
    assert resumed == uninterrupted


def test_abort_of_queued_request_and_abort_all(weights: dict[str, torch.Tensor]) -> None:
    engine = _engine(weights, num_slots=1)
    for request in _requests(3):
        engine.submit(request)
    engine.step()
    queued = engine.abort(102)
    assert queued is not None and queued.tokens == () and queued.finish_reason is FinishReason.ABORT
    rest = engine.abort_all()
    assert sorted(o.sample_id for o in rest) == [100, 101]
    assert not engine.has_work and engine.abort(555) is None


def test_weight_sync_mid_generation_mixes_versions(weights: dict[str, torch.Tensor]) -> None:
    engine = _engine(weights)
    request = GenerationRequest(sample_id=1, prompt=(1, 5, 6), max_new_tokens=20, seed=1)
    engine.submit(request)
    for _ in range(5):
        engine.step()
    engine.load_weights({k: v * 1.01 for k, v in weights.items()}, version=1)
    assert engine.stats().num_running == 0 and engine.stats().num_queued == 1
    (out,) = engine.run_until_idle()
    assert out.versions[:5] == (0,) * 5
    assert set(out.versions[5:]) <= {1} and len(out.versions) == len(out.tokens)
    with pytest.raises(ValueError, match="older"):
        engine.load_weights(weights, version=0)


def test_prefix_cache_serves_the_next_turn(weights: dict[str, torch.Tensor]) -> None:
    engine = _engine(weights)
    first = GenerationRequest(sample_id=1, prompt=(1, 5, 6, 7, 8), max_new_tokens=10, seed=2)
    engine.submit(first)
    (out,) = engine.run_until_idle()
    history = first.prompt + out.tokens + (30, 31)
    engine.submit(GenerationRequest(sample_id=1, prompt=history, max_new_tokens=5, seed=2))
    (second,) = engine.run_until_idle()
    # Everything the first turn computed (all but its last sampled token) is reused.
    assert second.cached_tokens == len(first.prompt) + len(out.tokens) - 1


def test_utilization_is_active_kv_over_capacity(weights: dict[str, torch.Tensor]) -> None:
    engine = _engine(weights, kv_capacity_tokens=512)
    for request in _requests(4):
        engine.submit(request)
    engine.step()
    stats = engine.stats()
    assert stats.kv_tokens > 0
    assert math.isclose(stats.utilization, stats.kv_tokens / 512)
    engine.run_until_idle()
    assert engine.utilization == 0.0


class _Lifo:
    """A RequestQueue that serves the newest request first."""

    def __init__(self) -> None:
        self.items: list[PendingRequest] = []

    def push(self, item: PendingRequest) -> None:
        self.items.append(item)

    def pop(self) -> PendingRequest:
        return self.items.pop()

    def remove(self, sample_id: int) -> PendingRequest | None:
        for item in self.items:
            if item.sample_id == sample_id:
                self.items.remove(item)
                return item
        return None

    def __len__(self) -> int:
        return len(self.items)


def test_injected_queue_decides_admission_order(weights: dict[str, torch.Tensor]) -> None:
    engine = RolloutEngine(
        MODEL, EngineConfig(max_seq_len=64, num_slots=1, deterministic=True), queue=_Lifo()
    )
    engine.load_weights(weights, version=0)
    for request in _requests(3):
        engine.submit(request)
    order = [o.sample_id for o in engine.run_until_idle()]
    assert order == [102, 101, 100]
    with pytest.raises(ValueError, match="already"):
        engine.submit(_requests(1)[0])
        engine.submit(_requests(1)[0])


def test_submit_and_config_validation(weights: dict[str, torch.Tensor]) -> None:
    engine = _engine(weights)
    with pytest.raises(ValueError, match="no room"):
        engine.submit(GenerationRequest(sample_id=1, prompt=(1,) * 64, max_new_tokens=1))
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        EngineConfig(max_seq_len=64, kv_capacity_tokens=10)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationRequest(sample_id=1, prompt=(1,), max_new_tokens=0)
    with pytest.raises(ValueError, match="nothing left"):
        GenerationRequest(
            sample_id=1,
            prompt=(1,),
            max_new_tokens=1,
            resumed_tokens=(3,),
            resumed_logprobs=(0.0,),
            resumed_versions=(0,),
        )
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match="set_num_threads"):
        RolloutEngine(MODEL, EngineConfig(max_seq_len=64, deterministic=True))


def test_prefix_cache_lru_and_longest_match() -> None:
    def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((1, 1, n, 2), float(n)), torch.full((1, 1, n, 2), -float(n))

    cache = PrefixCache(capacity_tokens=10)
    assert cache.insert((1, 2, 3), *kv(3))
    assert cache.insert((1, 2, 3, 4, 5), *kv(5))  # supersedes its prefix
    assert len(cache) == 1 and cache.num_tokens == 5
    assert not cache.insert((1, 2), *kv(2))  # already covered
    match = cache.match((1, 2, 3, 9))
    assert match is not None and match.length == 3 and match.keys.shape[2] == 3
    assert cache.insert((7, 8, 9, 10), *kv(4))
    cache.match((1, 2, 3, 4, 5))  # (1..5) becomes most recently used
    assert cache.insert((6, 6, 6), *kv(3))  # 5 + 4 + 3 > 10: evicts (7, 8, 9, 10)
    assert cache.match((7, 8)) is None and cache.evictions == 1
    assert cache.peek_length((1, 2, 3, 4, 0)) == 4
    assert not cache.insert(tuple(range(11)), *kv(11))
    cache.clear()
    assert cache.num_tokens == 0 and cache.match((1, 2)) is None


def test_sampling_is_keyed_and_follows_the_distribution() -> None:
    u = sampling_uniform(1, 2, 3)
    assert u == sampling_uniform(1, 2, 3) and 0 <= u < 1
    assert len({sampling_uniform(1, 2, p) for p in range(1000)}) == 1000
    logits = torch.tensor([[0.0, math.log(3.0), -1e9]]).repeat(4000, 1)
    uniforms = [sampling_uniform(0, 0, p) for p in range(4000)]
    tokens, logprobs = sample_tokens(logits, [1.0] * 4000, uniforms)
    share = float((tokens == 1).float().mean())
    assert 0.72 < share < 0.78  # p = 0.75
    assert torch.allclose(logprobs[tokens == 1], torch.tensor(math.log(0.75)))
    greedy, _ = sample_tokens(logits[:2], [0.0, 0.0], [0.99, 0.01])
    assert greedy.tolist() == [1, 1]
