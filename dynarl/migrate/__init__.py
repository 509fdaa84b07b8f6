"""State movement: reshard plans, the p2p executor, the three migration kinds."""

from __future__ import annotations

__all__: list[str] = []
