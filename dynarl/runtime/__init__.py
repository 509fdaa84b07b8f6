"""Processes, worker groups, launch, the migration coordinator and the journal."""

from __future__ import annotations

__all__: list[str] = []
