"""PrefixShadow, one rule of vLLM's block pool at a time (blocks of 4 tokens): shared and
counted blocks, admission in order, the last token never cached, copies, the eviction
order, failures and resets. The same rules against vLLM's own pool:
tests/engines/test_prefix_shadow_vllm.py."""

from __future__ import annotations

import pytest

from dynarl.sched import PrefixShadow

B = 4


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_siblings_share_their_prompts_blocks_and_each_holds_one_of_its_own() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=6)
    prompt = seq(0, 9)  # two full blocks and a partial one
    assert shadow.submit("a", prompt) == {"a": 0}
    hits = {**shadow.submit("b", prompt), **shadow.submit("c", prompt)}
    assert hits == {"b": 8, "c": 8}  # a's full blocks, cached as it started
    assert shadow.free_blocks == 6 - 3 - 1 - 1
    assert shadow.submit("d", prompt) == {"d": 8}
    assert shadow.free_blocks == 0 and shadow.running == ("a", "b", "c", "d")


def test_a_request_waits_until_its_prompt_fits_and_holds_back_those_behind_it() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=5)
    assert shadow.submit("a", seq(0, 12)) == {"a": 0}  # 3 blocks
    assert shadow.submit("big", seq(100, 12)) == {}  # needs 3, 2 are free
    assert shadow.submit("small", seq(200, 3)) == {}  # would fit: waits behind "big"
    assert shadow.waiting == ("big", "small")
    # a's end frees its blocks; both start, in order
    assert shadow.finish("a", [*seq(0, 12), 7]) == {"big": 0, "small": 0}
    assert not shadow.waiting


def test_a_waiting_request_gets_the_hit_the_cache_holds_when_it_starts() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=6)
    shadow.submit("a", seq(0, 8))
    shadow.submit("x", seq(50, 7))
    context = [*seq(0, 8), 90, 91, 92, 93, 94]
    prompt = [*context, 1, 2, 3, 4, 5]  # 5 blocks
    assert shadow.cached(prompt) == 8  # a's prompt, cached as it started
    assert shadow.submit("b", prompt) == {}  # 3 more blocks needed, 2 free
    # a's end caches its first 12 computed tokens; b still needs 2 new blocks and a's 3
    assert shadow.finish("a", context) == {}
    assert shadow.finish("x", seq(50, 8)) == {"b": 12}


def test_a_finished_sequence_caches_every_token_but_its_last() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=10)
    shadow.submit("a", seq(0, 5))
    shadow.finish("a", seq(0, 8))  # 5 prompt + 3 output tokens: 7 computed
    assert shadow.cached([*seq(0, 8), 99]) == 4
    shadow.submit("b", seq(0, 6))
    shadow.finish("b", seq(0, 9))  # 8 computed: two whole blocks
    assert shadow.cached([*seq(0, 9), 99]) == 8


def test_a_prompt_never_hits_its_last_token() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=10)
    shadow.submit("a", seq(0, 8))
    assert shadow.cached(seq(0, 8)) == 4
    assert shadow.cached(seq(0, 9)) == 8


def test_a_block_computed_twice_stays_cached_while_one_copy_does() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=6)
    prompt, done = seq(0, 3), seq(0, 9)  # identical greedy outputs: the same 2 blocks
    shadow.submit("a", prompt)
    shadow.submit("b", prompt)
    shadow.finish("a", done)
    shadow.finish("b", done)
    assert len(shadow) == 4  # two copies of each of the two blocks
    # a new request takes the 2 never-cached blocks, then evicts the 2 oldest freed (a's)
    shadow.submit("x", seq(100, 16))
    assert len(shadow) == 4 + 2  # x's blocks and b's copies
    assert shadow.cached(done) == 8  # b's copies still serve


def test_blocks_are_freed_tail_first_so_a_prefix_outlives_its_extension() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=4)
    shadow.submit("a", seq(0, 16))
    shadow.finish("a", [*seq(0, 16), 5])  # 4 cached blocks, freed last to first
    shadow.submit("x", seq(100, 5))  # takes 2: the deepest two of a's
    assert shadow.cached(seq(0, 17)) == 8


def test_never_cached_blocks_are_taken_before_any_cached_one() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=4)
    shadow.submit("a", seq(0, 6))  # one cached block and a partial one
    shadow.finish("a", seq(0, 7))  # the partial block goes back uncached
    assert shadow.free_blocks == 4 and len(shadow) == 1
    shadow.submit("x", seq(100, 12))  # three blocks: the never-cached ones
    assert shadow.cached(seq(0, 6)) == 4


def test_the_least_recently_freed_goes_first_and_a_hit_takes_a_block_back() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=2)
    for name, start in (("a", 0), ("b", 10)):
        shadow.submit(name, seq(start, 4))
        shadow.finish(name, seq(start, 5))
    shadow.submit("a2", [*seq(0, 4), 1])  # hits a's block, off the free list
    shadow.submit("x", seq(100, 2))  # the only free block: b's
    assert shadow.cached(seq(0, 5)) == 4 and shadow.cached(seq(10, 5)) == 0
    shadow.finish("a2", [*seq(0, 4), 1, 2])
    shadow.finish("x", seq(100, 3))
    shadow.submit("y", seq(200, 2))  # x's partial block, never cached, goes first
    assert shadow.cached(seq(0, 5)) == 4


def test_a_failed_request_frees_its_blocks_and_keeps_only_its_prompt_cached() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=4)
    shadow.submit("a", seq(0, 9))
    shadow.submit("b", seq(50, 12))  # waits
    assert shadow.finish("a") == {"b": 0}  # a's blocks are free: b starts
    # b took the two never-cached blocks and then a's deeper cached block
    assert shadow.cached(seq(0, 13)) == 4
    assert shadow.finish("a") == {} and shadow.finish("unknown") == {}


def test_a_reset_forgets_every_cached_block() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=4)
    shadow.submit("a", seq(0, 8))
    shadow.finish("a", seq(0, 9))
    shadow.clear()
    assert len(shadow) == 0 and shadow.cached(seq(0, 9)) == 0 and shadow.free_blocks == 4


def test_an_id_is_submitted_once_until_it_ends() -> None:
    shadow = PrefixShadow(block_size=B, capacity_blocks=4)
    shadow.submit("a", seq(0, 3))
    with pytest.raises(ValueError, match="already submitted"):
        shadow.submit("a", seq(0, 3))
    shadow.finish("a", seq(0, 4))
    assert shadow.submit("a", seq(0, 3)) == {"a": 0}


def test_with_prefill_batches_siblings_sent_together_each_compute_their_prompt() -> None:
    # SGLang (measured): a prompt is cached when the prefill batch that computed it ends
    shadow = PrefixShadow(block_size=1, capacity_blocks=100, prefill_batch_s=0.01)
    prompt = seq(0, 9)
    assert shadow.submit("a", [*prompt, 50], now=1.0) == {"a": 0}
    assert shadow.submit("b", [*prompt, 51], now=1.005) == {"b": 0}  # same batch: no hit
    assert shadow.free_blocks == 100 - 20  # two copies of the prompt
    assert shadow.cached(prompt) == 0
    # sent after the window: the batch has ended, its prompts are cached
    assert shadow.submit("c", [*prompt, 52], now=1.02) == {"c": 9}
    # one of a batch ending also ends the batch
    assert shadow.submit("d", seq(200, 6), now=2.0) == {"d": 0}
    assert shadow.submit("e", seq(300, 6), now=2.001) == {"e": 0}
    shadow.finish("e", [*seq(300, 6), 7], now=2.002)
    assert shadow.cached(seq(200, 6)) == 5  # d's prompt, all but its last token's block
    assert shadow.cached([*seq(300, 6), 7, 8]) == 6  # e computed its prompt, not its last token


def test_without_prefill_batches_a_sibling_sent_at_once_hits_the_prompt() -> None:
    shadow = PrefixShadow(block_size=1, capacity_blocks=100)  # vLLM's rule
    prompt = seq(0, 9)
    assert shadow.submit("a", [*prompt, 50], now=1.0) == {"a": 0}
    assert shadow.submit("b", [*prompt, 51], now=1.0) == {"b": 9}


def test_a_negative_prefill_window_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_batch_s must be None or >= 0"):
        PrefixShadow(block_size=1, capacity_blocks=4, prefill_batch_s=-1.0)
