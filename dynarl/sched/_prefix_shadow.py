"""A shadow of one engine's prefix cache: what a waiting request would find cached there.

DynaRL's request key orders by the reusable cached prefix (m_r); an engine does not say
what it holds before a request runs, so the dispatcher keeps a model of each engine's
cache and asks it. :class:`PrefixShadow` models the caches of both real engines with one
rule set:

* **blocks**: the cache holds whole blocks of ``block_size`` tokens (vLLM: 16 on GPU, 128
  on its CPU backend; SGLang's radix cache: 1), each identified by its tokens *and every
  token before it* (a hash chain, as vLLM hashes blocks), so two sequences share cached
  blocks exactly as far as their prefixes agree in whole blocks;
* **what is cached**: the blocks of a sequence the engine computed — a prompt's as soon as
  it is sent (an engine caches a block once it is full, so a sibling sent meanwhile hits
  it), a finished turn's prompt and output when it ends; within one sequence the *tail*
  blocks are the first to go (vLLM frees a request's blocks in reverse order, so that a
  prefix outlives its extensions), the most recently used sequences last;
* **capacity**: ``capacity_blocks`` blocks in all, less the blocks the requests running on
  the engine hold (:meth:`hold` / :meth:`release`); when cached blocks exceed what is left,
  the least recently used go;
* **a hit**: the longest cached chain of whole blocks of a prompt, never its last token
  (an engine always computes that one: vLLM caps a hit at ``len - 1`` rounded down to a
  block).

A model, checked against each request's reported ``cached_tokens`` by whoever runs it.
Pure data structure; not thread-safe.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefixCache", "PrefixShadow"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefixCache:
    """How an engine's prefix cache is laid out, for its shadow."""

    block_size: int
    """Tokens per cached block (vLLM: 16 on GPU, 128 on CPU; SGLang: 1)."""
    capacity_blocks: int
    """Blocks of KV the engine has (vLLM ``--num-gpu-blocks-override``; SGLang
    ``--max-total-tokens`` over the block size)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.capacity_blocks < 1:
            raise ValueError(
                f"PrefixCache needs block_size >= 1 and capacity_blocks >= 1, got "
                f"{self.block_size} and {self.capacity_blocks}"
            )


class PrefixShadow:
    """One engine's prefix cache, modelled (see the module docstring). Raises ValueError
    for a block size or capacity below 1."""

    def __init__(self, *, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError(
                f"PrefixShadow needs block_size >= 1 and capacity_blocks >= 1, got "
                f"{block_size} and {capacity_blocks}"
            )
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        """Cached block ids, least recently used first."""
        self._held: dict[str, int] = {}
        """Blocks each running request holds."""

    def __len__(self) -> int:
        """Cached blocks."""
        return len(self._blocks)

    @property
    def room(self) -> int:
        """Blocks the cache may keep now: the capacity less what running requests hold."""
        return max(0, self.capacity_blocks - sum(self._held.values()))

    def cached(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens``' longest cached prefix (whole blocks; never the last
        token). Does not touch the eviction order."""
        hit = 0
        for block_id in self._chain(tokens[: max(0, len(tokens) - 1)]):
            if block_id not in self._blocks:
                break
            hit += self.block_size
        return hit

    def insert(self, tokens: Sequence[int]) -> None:
        """The engine computed ``tokens``: their whole blocks are cached, most recently
        used (the first block last of all, so the tail goes first); the least recently used
        go beyond :attr:`room`."""
        for block_id in reversed(self._chain(tokens)):
            self._blocks[block_id] = None
            self._blocks.move_to_end(block_id)
        self._evict()

    def hold(self, request_id: str, num_tokens: int) -> None:
        """Request ``request_id`` runs, holding the blocks of ``num_tokens`` tokens (its
        prompt and the tokens it may generate): the cache has that much less room."""
        self._held[request_id] = -(-num_tokens // self.block_size)
        self._evict()

    def release(self, request_id: str) -> None:
        """Request ``request_id`` ended; its blocks are the cache's again (idempotent)."""
        self._held.pop(request_id, None)

    def clear(self) -> None:
        """The engine's cache was reset."""
        self._blocks.clear()

    def _evict(self) -> None:
        while len(self._blocks) > self.room:
            self._blocks.popitem(last=False)

    def _chain(self, tokens: Sequence[int]) -> list[bytes]:
        """The ids of ``tokens``' whole blocks, each hashing its predecessor's id."""
        out: list[bytes] = []
        parent = b""
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = tokens[start : start + size]
            digest = hashlib.blake2b(parent, digest_size=16)
            digest.update(b",".join(str(int(t)).encode() for t in block))
            parent = digest.digest()
            out.append(parent)
        return out
