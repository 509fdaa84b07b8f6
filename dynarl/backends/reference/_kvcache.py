"""The rollout engine's per-sequence KV cache: one fixed slot of keys and values per sequence.

A :class:`KVPool` holds, for every layer, ``num_slots`` slots of ``max_seq_len`` key and
value rows. A running sequence owns one slot; position p of the sequence lives at row p
of its slot, always, so a sequence's attention inputs sit at the same offsets whatever
else is in the batch — the property the deterministic decoder relies on. Slots are
zeroed when handed out, so rows past a sequence's length hold zeros, never another
sequence's values. Runs on the engine's compute thread; not thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynarl.errors import BackendError

__all__ = ["KVPool", "KVPoolShape"]


@dataclass(frozen=True, kw_only=True, slots=True)
class KVPoolShape:
    """Dimensions of a :class:`KVPool`."""

    num_layers: int
    """Transformer layers."""
    num_slots: int
    """Sequences that can run at once (the engine's maximum batch size)."""
    num_heads: int
    """Attention heads."""
    head_dim: int
    """Width of one head."""
    max_seq_len: int
    """Rows per slot: the longest sequence a slot holds."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_slots", "num_heads", "head_dim", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVPoolShape.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes(self) -> int:
        """Memory the pool takes (float32 keys and values)."""
        rows = self.num_layers * self.num_slots * self.max_seq_len
        return 2 * 4 * rows * self.num_heads * self.head_dim


class KVPool:
    """Keys and values of every running sequence, by slot and position."""

    def __init__(self, shape: KVPoolShape) -> None:
        self.shape = shape
        dims = (shape.num_layers, shape.num_slots, shape.num_heads, shape.max_seq_len)
        self.keys = torch.zeros(*dims, shape.head_dim)
        self.values = torch.zeros(*dims, shape.head_dim)
        self._free = list(range(shape.num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Slots not owned by a sequence."""
        return len(self._free)

    def allocate(self) -> int:
        """A zeroed free slot (the lowest-numbered); raises BackendError if none is free."""
        if not self._free:
            raise BackendError("KV pool has no free slot")
        slot = self._free.pop()
        self.keys[:, slot].zero_()
        self.values[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        """Give ``slot`` back; raises ValueError if it is not allocated."""
        if not 0 <= slot < self.shape.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)
        self._free.sort(reverse=True)

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Store one layer's keys and values ``(rows, heads, head_dim)`` at (slot, position)."""
        self.keys[layer, slots, :, positions] = keys
        self.values[layer, slots, :, positions] = values

    def window(
        self, layer: int, slots: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the first ``length`` rows of each slot: ``(rows, heads, length, head_dim)``."""
        keys = self.keys[layer, :, :, :length].index_select(0, slots)
        values = self.values[layer, :, :, :length].index_select(0, slots)
        return keys, values

    def load_prefix(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill positions ``[0, n)`` of ``slot`` from ``(layers, heads, n, head_dim)`` tensors."""
        n = keys.shape[2]
        self.keys[:, slot, :, :n] = keys
        self.values[:, slot, :, :n] = values

    def read_prefix(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of positions ``[0, length)`` of ``slot``, ``(layers, heads, length, d)``."""
        return (
            self.keys[:, slot, :, :length].clone(),
            self.values[:, slot, :, :length].clone(),
        )
