"""A discrete-event simulator that drives the real scheduler in virtual time."""

from __future__ import annotations

__all__: list[str] = []
