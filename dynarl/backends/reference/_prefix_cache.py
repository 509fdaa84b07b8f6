"""A prefix cache for the rollout engine: KV of earlier sequences, reused by later ones.

When a sequence finishes, stops for a tool call or is retracted, the engine stores the
keys and values of its computed tokens here. A later request whose prompt starts with
the same tokens — the next turn of the same episode, another sample of the same GRPO
group, a retracted request coming back — copies that KV into its slot and prefills only
the rest. Entries are kept in LRU order under a token capacity; an entry that is a
prefix of a newer one is dropped as redundant. A lookup returns the longest common
prefix with any entry, so a cached ``prompt + response A`` serves ``prompt + response B``
up to where they differ.

Simplification against SGLang's radix tree: entries that share a prefix but branch keep
their own copies of the shared part. Runs on the engine's compute thread.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PrefixCache", "PrefixMatch"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefixMatch:
    """KV for the first ``length`` tokens of a looked-up sequence."""

    length: int
    """Number of leading tokens covered."""
    keys: torch.Tensor
    """``(layers, heads, length, head_dim)`` (a view into the cache: copy before changing)."""
    values: torch.Tensor
    """Same shape as ``keys``."""


def _common_prefix(a: tuple[int, ...], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by binary search on C-speed slice compares."""
    b = tuple(b[: len(a)])
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi - 1:  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """LRU cache of per-sequence KV keyed by token prefixes, bounded in tokens.

    ``capacity_tokens=0`` disables it. Raises ValueError on a negative capacity or on an
    insert whose KV does not cover the tokens given.
    """

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"PrefixCache capacity_tokens must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = (
            OrderedDict()
        )
        self.num_tokens = 0
        self.hit_tokens = 0
        self.lookups = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, tokens: Sequence[int], *, min_length: int = 1) -> PrefixMatch | None:
        """The longest cached prefix of ``tokens`` (at least ``min_length`` long), or None.

        A hit moves its entry to the most-recently-used end.
        """
        self.lookups += 1
        if not tokens:
            return None
        best_key, best_len = None, 0
        for key in self._entries:
            if key[0] != tokens[0]:
                continue
            length = _common_prefix(key, tokens)
            if length > best_len:
                best_key, best_len = key, length
        if best_key is None or best_len < min_length:
            return None
        self._entries.move_to_end(best_key)
        keys, values = self._entries[best_key]
        self.hit_tokens += best_len
        return PrefixMatch(
            length=best_len, keys=keys[:, :, :best_len], values=values[:, :, :best_len]
        )

    def peek_length(self, tokens: Sequence[int]) -> int:
        """Length of the longest cached prefix of ``tokens``, without touching LRU order."""
        if not tokens:
            return 0
        return max(
            (_common_prefix(key, tokens) for key in self._entries if key[0] == tokens[0]),
            default=0,
        )

    def insert(self, tokens: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Cache the KV ``(layers, heads, len(tokens), head_dim)`` of ``tokens``.

        Returns whether it was stored (False when empty, larger than the capacity or
        already covered by an entry, which is then refreshed). Evicts least recently used
        entries to make room.
        """
        key = tuple(tokens)
        if keys.shape[2] != len(key) or values.shape != keys.shape:
            raise ValueError(f"KV covers {keys.shape[2]} tokens, expected {len(key)}")
        if not key or len(key) > self.capacity_tokens:
            return False
        for existing in list(self._entries):
            if len(existing) >= len(key) and existing[: len(key)] == key:
                self._entries.move_to_end(existing)
                return False
            if len(existing) < len(key) and key[: len(existing)] == existing:
                self._drop(existing)
        while self.num_tokens + len(key) > self.capacity_tokens:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        self._entries[key] = (keys, values)
        self.num_tokens += len(key)
        return True

    def clear(self) -> None:
        """Drop every entry (the weights changed, so cached KV is stale)."""
        if self._entries:
            logger.debug("prefix cache cleared (%d entries)", len(self._entries))
        self._entries.clear()
        self.num_tokens = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self.num_tokens -= len(key)
