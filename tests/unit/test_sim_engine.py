"""The simulated rollout engine: decode timing, admission, retraction, abort, priority, cache."""

from __future__ import annotations

import pytest

from dynarl.sched import FifoPolicy, PriorityPolicy, RequestPolicy
from dynarl.sim import EventLoop
from dynarl.sim._engine_model import Engine, SimRequest
from dynarl.sim._specs import RolloutSpec

SPEC = RolloutSpec(
    tp=1,
    kv_capacity_tokens=100_000,
    max_running_requests=64,
    step_fixed_s=0.005,
    step_per_seq_s=1e-5,
    step_per_kv_token_s=1e-8,
    prefill_tokens_per_s=100_000.0,
)


def _request(
    rid: int, target: int, *, prompt: int = 100, turn: int = 0, group: int = -1
) -> SimRequest:
    return SimRequest(
        rid=rid,
        sample=rid,
        group=rid if group < 0 else group,
        iteration=0,
        turn=turn,
        prompt=prompt,
        target=target,
        max_new=8000,
        fresh=prompt,
    )


def _engine(
    spec: RolloutSpec = SPEC, policy: RequestPolicy | None = None
) -> tuple[EventLoop, Engine, list[tuple[float, SimRequest]]]:
    loop = EventLoop()
    done: list[tuple[float, SimRequest]] = []
    engine = Engine(
        0, (0,), spec, policy or FifoPolicy(), loop, lambda _e, r: done.append((loop.now, r))
    )
    return loop, engine, done


def test_one_request_takes_the_sum_of_its_decode_steps() -> None:
    loop, engine, done = _engine()
    engine.submit(_request(0, 1000))
    loop.run(until=1e6, max_events=1000)
    steps = sum(SPEC.step_time(1, 100 + k) for k in range(1000))
    prefill = 100 / SPEC.prefill_tokens_per_s
    assert done[0][0] == pytest.approx(prefill + steps, rel=1e-3)
    assert engine.generated == pytest.approx(1000, rel=1e-6)


def test_shorter_requests_finish_first_and_speed_up_the_rest() -> None:
    loop, engine, done = _engine()
    engine.submit_many([_request(0, 2000), _request(1, 500)])
    loop.run(until=1e6, max_events=1000)
    assert [r.rid for _, r in done] == [1, 0]
    both = sum(SPEC.step_time(2, 200 + 2 * k) for k in range(500))
    alone = sum(SPEC.step_time(1, 100 + 500 + k) for k in range(1500))
    assert done[1][0] == pytest.approx(200 / SPEC.prefill_tokens_per_s + both + alone, rel=2e-3)


def test_admission_limit_queues_and_every_request_finishes_once() -> None:
    spec = RolloutSpec(**{**_fields(SPEC), "max_running_requests": 4})
    loop, engine, done = _engine(spec)
    engine.submit_many([_request(i, 100 + 10 * i) for i in range(20)])
    assert engine.batch == 4 and len(engine.waiting) == 16
    loop.run(until=1e6, max_events=10_000)
    assert sorted(r.rid for _, r in done) == list(range(20))


def test_full_kv_retracts_fewest_generated_first_and_nothing_is_lost() -> None:
    spec = RolloutSpec(
        **{
            **_fields(SPEC),
            "kv_capacity_tokens": 6_000,
            "new_token_ratio": 0.0,
            "min_new_token_ratio": 0.0,
        }
    )
    loop, engine, done = _engine(spec)
    engine.submit_many([_request(i, 2500) for i in range(4)])
    loop.run(until=1e6, max_events=100_000)
    assert engine.num_retractions > 0
    assert engine.reprefill_tokens > 0, "a retracted request re-prefills its prompt and output"
    assert sorted(r.rid for _, r in done) == [0, 1, 2, 3]
    assert all(r.done == r.target for _, r in done)


def test_abort_returns_every_request_with_its_partial_output() -> None:
    spec = RolloutSpec(**{**_fields(SPEC), "max_running_requests": 3})
    loop, engine, _ = _engine(spec)
    engine.submit_many([_request(i, 5000) for i in range(5)])
    loop.run(until=10.0, max_events=10_000)
    loop.clock.time = 10.0
    out = engine.abort()
    assert sorted(r.rid for r in out) == [0, 1, 2, 3, 4]
    running = [r for r in out if r.done > 0]
    assert len(running) == 3 and all(0 < r.done < r.target for r in running)
    assert not engine.alive and engine.batch == 0 and not engine.waiting


def test_priority_admits_later_turns_first_fifo_by_arrival() -> None:
    for policy, first in ((FifoPolicy(), 0), (PriorityPolicy(), 2)):
        spec = RolloutSpec(**{**_fields(SPEC), "max_running_requests": 1})
        loop, engine, done = _engine(spec, policy)
        engine.submit(_request(9, 50))  # occupies the only slot
        engine.submit(_request(0, 50))
        engine.submit(_request(1, 50))
        engine.submit(_request(2, 50, turn=2))
        loop.run(until=1e6, max_events=1000)
        assert [r.rid for _, r in done][1] == first


def test_evicting_a_cached_context_rekeys_the_waiting_turn() -> None:
    spec = RolloutSpec(
        **{
            **_fields(SPEC),
            "kv_capacity_tokens": 3_000,
            "max_running_requests": 1,
            "new_token_ratio": 0.0,
            "min_new_token_ratio": 0.0,
        }
    )
    loop, engine, _ = _engine(spec, PriorityPolicy())
    first = _request(0, 400, prompt=500)
    first.cache_after = True
    engine.submit(first)
    loop.run(until=1e6, max_events=1000)
    assert engine.cache, "the finished turn's context stays cached"
    engine.submit(_request(5, 1900, prompt=600))  # runs and grows into the cached space
    follow = _request(0, 100, prompt=1000, turn=1)
    follow.fresh = 100  # the tool's observation; the rest was prefilled on turn 0
    engine.submit(follow)
    assert {q.request_id: q for q in engine.queue}["0"].cached_prefix == 900
    loop.run(until=loop.now + 9.0, max_events=10_000)
    assert (1, 0, 0) not in engine.cache, "running KV needed the room"
    assert {q.request_id: q for q in engine.queue}["0"].cached_prefix == 0
    loop.run(until=1e6, max_events=10_000)
    assert engine.reprefill_tokens >= 900, "the evicted context was prefilled again"


def _fields(spec: RolloutSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


@pytest.mark.parametrize("shared", [False, True])
def test_siblings_share_a_cached_prompt_and_eviction_keeps_a_prefix_head(shared: bool) -> None:
    spec = RolloutSpec(
        **{**_fields(SPEC), "kv_capacity_tokens": 3_000, "shared_prefix": shared,
           "cache_block_tokens": 16, "new_token_ratio": 0.0, "min_new_token_ratio": 0.0}
    )  # fmt: skip
    loop, engine, done = _engine(spec)
    engine.submit_many([_request(i, 50, prompt=1_000, group=7) for i in range(2)])
    engine.advance(loop.now)
    # The group's prompt is cached once prefilled; with sharing both siblings run on it.
    assert engine.batch == 2
    assert engine.kv_tokens == (1_000 if shared else 2_000)
    loop.run(until=1e6, max_events=1000)
    assert len(done) == 2 and engine.pinned_tokens == 0 and engine.shared_kv == 0
    first = _request(5, 400, prompt=500)
    first.cache_after = True
    engine.submit(first)
    loop.run(until=1e6, max_events=1000)
    engine.submit(_request(6, 1_500, prompt=600))  # grows into the cached space
    loop.run(until=1e6, max_events=10_000)
    left = engine.cache.get((1, 0, 5), 0)
    if shared:
        assert 0 < left < 900 and (900 - left) % 16 == 0, "the tail went, in whole blocks"
    else:
        assert left == 0, "the validated model evicts a prefix whole"


@pytest.mark.parametrize("after_prefill", [False, True])
def test_siblings_in_one_prefill_batch_reuse_their_prompt_only_on_vllms_rule(
    after_prefill: bool,
) -> None:
    spec = RolloutSpec(
        **{**_fields(SPEC), "kv_capacity_tokens": 10_000, "shared_prefix": True,
           "prefix_cached_after_prefill": after_prefill, "new_token_ratio": 0.0,
           "min_new_token_ratio": 0.0, "max_running_requests": 3}
    )  # fmt: skip
    loop, engine, done = _engine(spec)
    engine.submit_many([_request(i, 50, prompt=1_000, group=7) for i in range(3)])
    engine.advance(loop.now)
    assert engine.batch == 3
    # vLLM caches the prompt's blocks as the first sibling is scheduled: the other two hit
    # them; SGLang inserts it after the batch's prefill: all three computed it.
    assert engine.hit_tokens == (0 if after_prefill else 2_000)
    assert engine.prefill_tokens == (3_000 if after_prefill else 1_000)
    assert engine.kv_tokens == (3_000 if after_prefill else 1_000)
    loop.run(until=1e6, max_events=1000)
    assert len(done) == 3 and engine.pinned_tokens == 0 and engine.shared_kv == 0
    engine.submit(_request(3, 50, prompt=1_000, group=7))  # a later batch reuses it either way
    engine.advance(loop.now)
    assert engine.hit_tokens == (1_000 if after_prefill else 3_000)


def test_eviction_from_a_tail_always_frees_a_block_even_for_float_noise() -> None:
    # With shared_prefix the cut was ceil(excess / block - eps) blocks: an excess below
    # eps (float drift in the running sums) cut nothing and the loop never ended.
    spec = RolloutSpec(**{**_fields(SPEC), "kv_capacity_tokens": 1_000, "shared_prefix": True})
    _, engine, _ = _engine(spec)
    engine.cache[(1, 0, 0)] = 100
    engine.cached_tokens = 100
    engine.kv_base = 900 + 1e-9  # over the capacity by float noise
    engine._evict()
    assert engine.cache[(1, 0, 0)] == 99 and engine.cached_tokens == 99
