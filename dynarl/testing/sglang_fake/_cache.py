"""A token-level radix (prefix) cache with lock counts and LRU eviction, as SGLang keeps one.

One node per cached token. A request locks the path of its matched prefix while it runs,
so those tokens cannot be evicted; unlocked nodes are *evictable* and count as free memory
in SGLang's ``token_usage`` (``num_used = capacity - (available + evictable)``). Runs on
the fake server's event loop only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["PrefixCache", "PrefixNode"]


class PrefixNode:
    """One cached token: its children, its lock count and when it was last used."""

    __slots__ = ("children", "last_used", "lock", "parent", "token")

    def __init__(self, token: int, parent: PrefixNode | None) -> None:
        self.token = token
        self.parent = parent
        self.children: dict[int, PrefixNode] = {}
        self.lock = 0
        self.last_used = 0


class PrefixCache:
    """Token trie holding cached prefixes; its size counts against the KV pool."""

    def __init__(self) -> None:
        self.root = PrefixNode(-1, None)
        self.size = 0
        self.locked = 0
        self._clock = itertools.count(1)

    @property
    def evictable(self) -> int:
        """Cached tokens no running request holds."""
        return self.size - self.locked

    def match(self, tokens: Sequence[int]) -> tuple[int, PrefixNode]:
        """Length of the longest cached prefix of ``tokens`` and its last node."""
        node = self.root
        now = next(self._clock)
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                break
            child.last_used = now
            node = child
        return self._depth(node), node

    def insert(self, tokens: Sequence[int]) -> PrefixNode:
        """Cache ``tokens`` (extending what is there); returns the last node."""
        node = self.root
        now = next(self._clock)
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                child = PrefixNode(token, node)
                node.children[token] = child
                self.size += 1
            child.last_used = now
            node = child
        return node

    def lock(self, node: PrefixNode) -> None:
        """Pin the path from ``node`` to the root (a running request uses it)."""
        while node.parent is not None:
            if node.lock == 0:
                self.locked += 1
            node.lock += 1
            node = node.parent

    def unlock(self, node: PrefixNode) -> None:
        """Release a pin taken by :meth:`lock`."""
        while node.parent is not None:
            assert node.lock > 0, "unlock without lock"
            node.lock -= 1
            if node.lock == 0:
                self.locked -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Drop up to ``num_tokens`` unlocked leaf tokens, least recently used first."""
        freed = 0
        while freed < num_tokens:
            leaves = [node for node in self._nodes() if not node.children and node.lock == 0]
            if not leaves:
                break
            leaves.sort(key=lambda node: node.last_used)
            for leaf in leaves[: num_tokens - freed]:
                assert leaf.parent is not None
                del leaf.parent.children[leaf.token]
                self.size -= 1
                freed += 1
        return freed

    def reset(self) -> None:
        """Drop everything (``/flush_cache``); only valid with no locks held."""
        assert self.locked == 0, "reset while requests hold cached prefixes"
        self.root = PrefixNode(-1, None)
        self.size = 0

    def _nodes(self) -> list[PrefixNode]:
        stack = list(self.root.children.values())
        nodes: list[PrefixNode] = []
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    @staticmethod
    def _depth(node: PrefixNode) -> int:
        depth = 0
        while node.parent is not None:
            depth += 1
            node = node.parent
        return depth
