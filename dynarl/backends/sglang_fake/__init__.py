"""A faithful fake of SGLang 0.5.23's native HTTP server, for testing on machines without GPUs.

Users reach it as :class:`dynarl.testing.FakeSGLangServer`; ``python -m
dynarl.backends.sglang_fake`` serves one from the command line (with the subset of
``sglang.launch_server`` flags it models), which is how the launcher is tested.
"""

from __future__ import annotations

from dynarl.backends.sglang_fake.config import FakeSGLangConfig
from dynarl.backends.sglang_fake.scheduler import FakeScheduler
from dynarl.backends.sglang_fake.server import FakeSGLangServer

__all__ = ["FakeSGLangConfig", "FakeSGLangServer", "FakeScheduler"]
