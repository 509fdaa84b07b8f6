"""The main job: a GRPO experiment on the reference backend, run under several schedules.

What ``dynarl demo`` runs. It sits above the library: nothing in ``dynarl`` below it
imports it. Importing this package is light (the CLI builds its parser from it);
:func:`run_grpo` and :class:`SmokeConfig` — the whole job in one process — and
:func:`write_task_llama` — the job's policy as a Hugging Face checkpoint a real engine and
the Megatron trainer both load — import the reference backend (torch and Megatron-core) on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynarl.demo._demo import DESCRIPTION, SUMMARY, add_arguments, main

if TYPE_CHECKING:
    from dynarl.demo._engine_model import write_task_llama
    from dynarl.demo._smoke import SmokeConfig, run_grpo

__all__ = [
    "DESCRIPTION",
    "SUMMARY",
    "SmokeConfig",
    "add_arguments",
    "main",
    "run_grpo",
    "write_task_llama",
]

_LAZY = frozenset({"SmokeConfig", "run_grpo", "write_task_llama"})


def __getattr__(name: str) -> Any:
    if name == "write_task_llama":
        from dynarl.demo import _engine_model

        return _engine_model.write_task_llama
    if name in _LAZY:
        from dynarl.demo import _smoke

        return getattr(_smoke, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
