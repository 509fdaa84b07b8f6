"""The decision plane: pipeline hypergraph, donor detection, candidate evaluation, policies."""

from __future__ import annotations

__all__: list[str] = []
