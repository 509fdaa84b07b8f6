"""The sample source: a deterministic, seekable stream of sample tickets.

Position ``p`` of the stream is a pure function of the configuration: the prompt slot
``p // group_size``, its pass over the dataset (``epoch``) and its dataset item (a keyed
permutation of each epoch, computed on the fly by a Feistel network with cycle walking, so
seeking costs O(1) whatever the dataset size). A job's sample cursor is the position of
the next ticket; a checkpoint stores it and a restore seeks back to it, so a resumed job
issues exactly the tickets (ids, items, per-sample seeds) the uninterrupted job would have.

Everything is derived with BLAKE2b, never with a library RNG whose stream may change
between versions. Pure; runs on the controller.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["SampleSource", "SourceConfig", "Ticket"]

_ROUNDS = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig:
    """What fixes a sample stream."""

    seed: int
    """Seed of the permutations and of the per-sample seeds."""
    num_items: int
    """Items (prompts) in the dataset."""
    group_size: int = 1
    """Samples issued per item in a row (GRPO's group)."""
    shuffle: bool = True
    """Whether each pass visits the items in a seeded random order (else in order)."""

    def __post_init__(self) -> None:
        if self.num_items < 1:
            raise ValueError(f"SourceConfig.num_items must be >= 1, got {self.num_items}")
        if self.group_size < 1:
            raise ValueError(f"SourceConfig.group_size must be >= 1, got {self.group_size}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Ticket:
    """One sample to generate: which item, under which id, with which sampling seed."""

    sample_id: str
    """Unique, stable id, carried from the source to the trainer."""
    position: int
    """Its position in the stream (the cursor before it was issued)."""
    prompt_id: str
    """Id of its group (one item in one epoch)."""
    item: int
    """Dataset index of the prompt."""
    epoch: int
    """Pass over the dataset."""
    member: int
    """Index within its group."""
    seed: int
    """Sampling seed of this sample (non-negative, 63 bits), from the source seed and id."""


def _hash(*parts: object) -> int:
    text = "/".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def permute(index: int, size: int, key: int) -> int:
    """The image of ``index`` under a keyed bijection of ``range(size)`` (pure)."""
    if not 0 <= index < size:
        raise ValueError(f"index {index} outside range({size})")
    if size == 1:
        return 0
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    value = index
    while True:  # cycle walking; the domain is < 4 * size, so < 4 trips on average
        left, right = value >> half, value & mask
        for round_ in range(_ROUNDS):
            left, right = right, left ^ (_hash(key, round_, right) & mask)
        value = (left << half) | right
        if value < size:
            return value


class SampleSource:
    """Tickets from position ``cursor`` on. Not thread-safe; one per controller.

    Raises ValueError for a negative cursor or count.
    """

    def __init__(self, config: SourceConfig, *, cursor: int = 0) -> None:
        self.config = config
        self._cursor = 0
        self.seek(cursor)

    @property
    def cursor(self) -> int:
        """Position of the next ticket."""
        return self._cursor

    def seek(self, cursor: int) -> None:
        """Continue from ``cursor`` (a checkpoint's, to resume the same stream)."""
        if cursor < 0:
            raise ValueError(f"sample cursor must be >= 0, got {cursor}")
        self._cursor = cursor

    def ticket(self, position: int) -> Ticket:
        """The ticket at ``position`` (pure: does not move the cursor)."""
        if position < 0:
            raise ValueError(f"stream position must be >= 0, got {position}")
        config = self.config
        slot, member = divmod(position, config.group_size)
        epoch, index = divmod(slot, config.num_items)
        item = index
        if config.shuffle:
            item = permute(index, config.num_items, _hash(config.seed, "epoch", epoch))
        prompt_id = f"e{epoch}-i{item}"
        sample_id = f"{prompt_id}-g{member}"
        return Ticket(
            sample_id=sample_id,
            position=position,
            prompt_id=prompt_id,
            item=item,
            epoch=epoch,
            member=member,
            seed=_hash(config.seed, "sample", sample_id) >> 1,
        )

    def take(self, num_samples: int) -> list[Ticket]:
        """The next ``num_samples`` tickets; advances the cursor past them."""
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        start = self._cursor
        self._cursor += num_samples
        return [self.ticket(p) for p in range(start, start + num_samples)]
