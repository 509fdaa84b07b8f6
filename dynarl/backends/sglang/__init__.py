"""SGLang rollout engines driven over SGLang 0.5.23's native HTTP API (extra ``sglang``)."""

from __future__ import annotations

__all__: list[str] = []
