"""Model-based: PrefixShadow against a naive model that keeps every cached block as the
tuple of tokens up to its end (no hashing), in LRU order, under inserts, holds, releases
and lookups over a tiny alphabet (so prefixes are shared and diverge often)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dynarl.sched import PrefixShadow

TOKENS = st.lists(st.integers(0, 2), max_size=14)


class ShadowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.size, self.capacity = 2, 6
        self.shadow = PrefixShadow(block_size=self.size, capacity_blocks=self.capacity)
        self.blocks: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.held: dict[str, int] = {}

    def room(self) -> int:
        return max(0, self.capacity - sum(self.held.values()))

    def evict(self) -> None:
        while len(self.blocks) > self.room():
            self.blocks.popitem(last=False)

    @rule(tokens=TOKENS)
    def insert(self, tokens: list[int]) -> None:
        self.shadow.insert(tokens)
        ends = range(self.size, len(tokens) + 1, self.size)
        for end in reversed(ends):  # the tail first: the head is the most recently used
            self.blocks[tuple(tokens[:end])] = None
            self.blocks.move_to_end(tuple(tokens[:end]))
        self.evict()

    @rule(tokens=TOKENS)
    def lookup(self, tokens: list[int]) -> None:
        hit = 0
        for end in range(self.size, len(tokens), self.size):  # never the last token
            if tuple(tokens[:end]) not in self.blocks:
                break
            hit = end
        assert self.shadow.cached(tokens) == hit

    @rule(request=st.sampled_from("abc"), tokens=st.integers(0, 8))
    def hold(self, request: str, tokens: int) -> None:
        self.shadow.hold(request, tokens)
        self.held[request] = -(-tokens // self.size)
        self.evict()

    @rule(request=st.sampled_from("abc"))
    def release(self, request: str) -> None:
        self.shadow.release(request)
        self.held.pop(request, None)

    @invariant()
    def within_room(self) -> None:
        assert len(self.shadow) == len(self.blocks) <= max(self.room(), 0)
        assert self.shadow.room == self.room()


TestShadowMachine = ShadowMachine.TestCase


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=600), st.sampled_from([1, 16, 128]))
def test_a_computed_sequence_hits_in_whole_blocks_short_of_its_last_token(
    tokens: list[int], size: int
) -> None:
    shadow = PrefixShadow(block_size=size, capacity_blocks=10_000)
    shadow.insert(tokens)
    assert shadow.cached(tokens) == (len(tokens) - 1) // size * size
    longer = [*tokens, 7, 8, 9]
    assert shadow.cached(longer) == len(tokens) // size * size


def test_nonsense_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixShadow(block_size=0, capacity_blocks=4)
