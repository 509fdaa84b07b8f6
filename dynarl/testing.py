"""Test seams shipped for users: fakes, in-process transports and hypothesis strategies.

``FakeSGLangServer`` and ``FakeSGLangConfig`` (a loopback fake of SGLang 0.5.23's HTTP API)
are imported on first use, since they need the ``sglang`` extra (aiohttp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynarl.backends.sglang_fake import FakeSGLangConfig, FakeSGLangServer

__all__: list[str] = ["FakeSGLangConfig", "FakeSGLangServer"]

_LAZY = {"FakeSGLangConfig", "FakeSGLangServer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from dynarl.backends import sglang_fake

        return getattr(sglang_fake, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
