"""Test seams shipped for users: fakes, in-process transports and hypothesis strategies."""

from __future__ import annotations

__all__: list[str] = []
