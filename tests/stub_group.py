"""A stand-in process group for tests that build Megatron modules or buffers without a job."""

from __future__ import annotations

__all__ = ["StubGroup"]


class StubGroup:
    """A group of ``size`` ranks seen from ``rank``: only rank() and size()."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size
