"""Model-based: PrefixShadow against a naive block pool that keys every cached block by the
tuple of tokens up to its end (no hashing) and keeps its free blocks in one list, under
submissions, ends (with output, or failed), lookups and resets over a tiny alphabet (so
prefixes are shared, diverge and are computed twice often)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dynarl.sched import PrefixShadow

TOKENS = st.lists(st.integers(0, 2), max_size=12)
IDS = st.sampled_from("abcd")


class NaivePool:
    """vLLM's block pool, slowly: ``key[b]`` is the prefix block ``b`` caches (None: none);
    ``free`` lists the free blocks, the next taken first."""

    def __init__(self, size: int, capacity: int) -> None:
        self.size = size
        self.key: list[tuple[int, ...] | None] = [None] * capacity
        self.free = list(range(capacity))
        self.refs = [0] * capacity
        self.running: dict[str, tuple[list[int], int]] = {}
        self.waiting: list[tuple[str, list[int]]] = []
        self.cached_order: list[int] = []
        """Blocks in the order they were cached (the first copy serves a hit)."""

    def hit(self, tokens: list[int]) -> list[int]:
        out = []
        for end in range(self.size, len(tokens), self.size):  # never the last token
            holders = [b for b in range(len(self.key)) if self.key[b] == tuple(tokens[:end])]
            if not holders:
                break
            out.append(min(holders, key=self.cached_order.index))
        return out

    def take(self) -> int:
        block = self.free.pop(0)
        if self.key[block] is not None:
            self.key[block] = None
            self.cached_order.remove(block)
        self.refs[block] = 1
        return block

    def cache(self, blocks: list[int], done: int, tokens: list[int]) -> int:
        full = min(len(tokens) // self.size, len(blocks))
        for i in range(done, full):
            self.key[blocks[i]] = tuple(tokens[: (i + 1) * self.size])
            self.cached_order.append(blocks[i])
        return max(done, full)

    def admit(self) -> dict[str, int]:
        started = {}
        while self.waiting:
            name, tokens = self.waiting[0]
            hit = self.hit(tokens)
            need = -(-len(tokens) // self.size) - len(hit)
            if need + sum(self.refs[b] == 0 for b in hit) > len(self.free):
                break
            self.waiting.pop(0)
            for b in hit:
                if self.refs[b] == 0:
                    self.free.remove(b)
                self.refs[b] += 1
            blocks = hit + [self.take() for _ in range(need)]
            self.running[name] = (blocks, self.cache(blocks, len(hit), tokens))
            started[name] = len(hit) * self.size
        return started

    def finish(self, name: str, tokens: list[int] | None) -> dict[str, int]:
        blocks, done = self.running.pop(name)
        if tokens is not None:
            computed = tokens[:-1]
            while len(blocks) < -(-len(computed) // self.size) and self.free:
                blocks.append(self.take())
            self.cache(blocks, done, computed)
        fresh = []
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.key[b] is None:
                    fresh.append(b)
                else:
                    self.free.append(b)
        self.free = fresh + self.free
        return self.admit()


class ShadowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.size, self.capacity = 2, 6
        self.shadow = PrefixShadow(block_size=self.size, capacity_blocks=self.capacity)
        self.model = NaivePool(self.size, self.capacity)
        self.prompts: dict[str, list[int]] = {}
        self.contexts: list[list[int]] = []
        """Finished sequences, which a next turn extends."""

    @rule(name=IDS, tokens=TOKENS)
    def submit(self, name: str, tokens: list[int]) -> None:
        if name in self.prompts:
            return
        self.prompts[name] = tokens
        self.model.waiting.append((name, tokens))
        assert self.shadow.submit(name, tokens) == self.model.admit()

    @precondition(lambda self: bool(self.contexts))
    @rule(name=IDS, data=st.data(), observation=st.lists(st.integers(0, 2), max_size=4))
    def next_turn(self, name: str, data: st.DataObject, observation: list[int]) -> None:
        self.submit(name, data.draw(st.sampled_from(self.contexts)) + observation)

    @precondition(lambda self: bool(self.model.running))
    @rule(data=st.data(), output=st.none() | st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def finish(self, data: st.DataObject, output: list[int] | None) -> None:
        name = data.draw(st.sampled_from(sorted(self.model.running)))
        tokens = None if output is None else self.prompts[name] + output
        if tokens is not None:
            self.contexts.append(tokens)
        assert self.shadow.finish(name, tokens) == self.model.finish(name, tokens)
        del self.prompts[name]

    @rule(tokens=TOKENS)
    def lookup(self, tokens: list[int]) -> None:
        assert self.shadow.cached(tokens) == len(self.model.hit(tokens)) * self.size

    @invariant()
    def same_pool(self) -> None:
        assert self.shadow.free_blocks == len(self.model.free)
        assert len(self.shadow) == sum(k is not None for k in self.model.key)
        assert self.shadow.waiting == tuple(n for n, _ in self.model.waiting)
        assert set(self.shadow.running) == set(self.model.running)
        held = {b for blocks, _ in self.model.running.values() for b in blocks}
        assert len(held) + len(self.model.free) == self.capacity


TestShadowMachine = ShadowMachine.TestCase


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=600), st.sampled_from([1, 16, 128]))
def test_a_finished_sequence_hits_in_whole_blocks_short_of_its_last_token(
    tokens: list[int], size: int
) -> None:
    shadow = PrefixShadow(block_size=size, capacity_blocks=10_000)
    shadow.submit("a", tokens[:1])
    shadow.finish("a", tokens)
    computed = max(1, len(tokens) - 1)  # the prompt, and the output but its last token
    assert shadow.cached([*tokens, 7, 8, 9]) == computed // size * size
    assert shadow.cached(tokens) == min(computed, len(tokens) - 1) // size * size
