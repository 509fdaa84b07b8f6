"""A faithful fake of SGLang 0.5.23's native HTTP server, for testing on machines without GPUs.

Users reach it as :class:`dynarl.testing.FakeSGLangServer`; ``python -m
dynarl.testing.sglang_fake`` serves one from the command line (with the subset of
``sglang.launch_server`` flags it models), which is how the launcher is tested.
"""

from __future__ import annotations

from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._scheduler import FakeScheduler
from dynarl.testing.sglang_fake._server import FakeSGLangServer

__all__ = ["FakeSGLangConfig", "FakeSGLangServer", "FakeScheduler"]
