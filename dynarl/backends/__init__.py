"""Engines and trainers dynarl drives: the CPU reference backend, SGLang, Megatron-core."""

from __future__ import annotations

__all__: list[str] = []
