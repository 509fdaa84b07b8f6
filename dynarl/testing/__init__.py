"""Test seams shipped for users: fakes, in-process transports, hypothesis strategies, and
runtime components (:class:`ScriptedRollout`, :class:`TinyTrainer`).

The hypothesis strategies of valid pipelines, allocations, reports, requests, hybrid
contexts, layouts and workloads live in :mod:`dynarl.testing._strategies` and are re-exported here;
those of bus messages — :func:`message_strategy` (valid messages, built from the rules the
message types declare) and :func:`arbitrary_message_strategy` (any values of the declared
types, for fuzzing decoders) — in :mod:`dynarl.testing._seams`.

``FakeSGLangServer`` and ``FakeSGLangConfig`` (a loopback fake of SGLang 0.5.23's HTTP API)
are imported on first use, since they need the ``sglang`` extra (aiohttp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynarl.testing._message_strategies import arbitrary_message_strategy, message_strategy
from dynarl.testing._seams import (
    AllReduce,
    ScriptedRollout,
    ShadowTrainer,
    TinyState,
    TinyTrainer,
    scripted_token,
    tiny_param_specs,
)
from dynarl.testing._strategies import (
    allocations,
    component_reports,
    layouts,
    pipelines,
    queued_requests,
    report_rounds,
    schedule_contexts,
    workloads,
)

if TYPE_CHECKING:
    from dynarl.testing.sglang_fake import FakeSGLangConfig, FakeSGLangServer


__all__ = [
    "AllReduce",
    "FakeSGLangConfig",
    "FakeSGLangServer",
    "ScriptedRollout",
    "ShadowTrainer",
    "TinyState",
    "TinyTrainer",
    "allocations",
    "arbitrary_message_strategy",
    "component_reports",
    "layouts",
    "message_strategy",
    "pipelines",
    "queued_requests",
    "report_rounds",
    "schedule_contexts",
    "scripted_token",
    "tiny_param_specs",
    "workloads",
]

_LAZY = frozenset({"FakeSGLangConfig", "FakeSGLangServer"})


def __getattr__(name: str) -> Any:
    # The fake needs the ``sglang`` extra (aiohttp): imported on first use.
    if name in _LAZY:
        from dynarl.testing import sglang_fake

        return getattr(sglang_fake, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
