"""Workload migration and hybrid activate/deactivate of an SGLang engine, as step lists.

A plan is a tuple of frozen steps, built by a pure function and carried out by
:func:`execute_steps`; the runtime and the hybrid controller log and send plans as they are.

- **deactivate** (and the donor side of a workload migration): stop routing to the engine →
  pause with ``abort`` (in-flight requests return partial outputs to their callers, who
  re-dispatch them elsewhere, and requests already on their way wait instead of starting)
  → wait until the server is idle (``/v1/loads``) → release memory.
- **activate**: resume memory → sync weights (when the weights were released without a CPU
  backup, or are stale) → continue generation → route to the engine again.

The engine-facing protocols are defined here (``dynarl.runtime`` defines none for
engines); :class:`~dynarl.backends.sglang._sglang_engine.SGLangEngine` implements
:class:`EngineControl`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dynarl.backends.sglang._http_wire import MEMORY_TAGS, PauseMode

__all__ = [
    "AddToRouting",
    "Continue",
    "EngineControl",
    "Pause",
    "ReleaseMemory",
    "RemoveFromRouting",
    "ResumeMemory",
    "Router",
    "Step",
    "SyncWeights",
    "WaitIdle",
    "execute_steps",
    "plan_activate",
    "plan_deactivate",
    "plan_workload_drain",
]

logger = logging.getLogger(__name__)


class EngineControl(Protocol):
    """What the steps need from an engine (``SGLangEngine`` provides it)."""

    engine_id: str

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Pause generation."""

    async def continue_generation(self) -> None:
        """Resume generation."""

    async def wait_idle(
        self, *, timeout_s: float | None = None, ignore_waiting: bool = False
    ) -> object:
        """Return once nothing runs (or waits); raise BackendError after ``timeout_s``."""

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Release memory by tag."""

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take released memory back."""


class Router(Protocol):
    """Where requests are routed among engines (the runtime's request router)."""

    def remove_engine(self, engine_id: str) -> None:
        """Send no new request to ``engine_id``."""

    def add_engine(self, engine_id: str) -> None:
        """Send requests to ``engine_id`` again."""


WeightSyncer = Callable[[str], Awaitable[None]]
"""Pushes the trainer's current weights to the engine with this id."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RemoveFromRouting:
    """Stop routing new requests to the engine."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AddToRouting:
    """Route requests to the engine again."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pause:
    """``/pause_generation`` in ``mode``."""

    mode: PauseMode = "abort"
    """Abort in-flight requests, retract them to the queue, or freeze them in place."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Continue:
    """``/continue_generation``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WaitIdle:
    """Poll ``/v1/loads`` until nothing runs or waits."""

    timeout_s: float
    """Give up (BackendError) after this long."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReleaseMemory:
    """``/release_memory_occupation``."""

    tags: tuple[str, ...] = MEMORY_TAGS
    """Memory released."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeMemory:
    """``/resume_memory_occupation``."""

    tags: tuple[str, ...] = MEMORY_TAGS
    """Memory taken back."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncWeights:
    """Push the trainer's current weights to the engine."""


Step = (
    RemoveFromRouting
    | AddToRouting
    | Pause
    | Continue
    | WaitIdle
    | ReleaseMemory
    | ResumeMemory
    | SyncWeights
)


def _check_tags(tags: Sequence[str]) -> tuple[str, ...]:
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown or not tags:
        raise ValueError(f"memory tags must be a non-empty subset of {MEMORY_TAGS}, got {tags}")
    return tuple(tag for tag in MEMORY_TAGS if tag in tags)


def plan_deactivate(
    *, release_tags: Sequence[str] = MEMORY_TAGS, idle_timeout_s: float = 60.0
) -> tuple[Step, ...]:
    """Hybrid deactivate: unroute → pause(abort) → wait idle → release ``release_tags``."""
    if idle_timeout_s <= 0:
        raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
    return (
        RemoveFromRouting(),
        Pause(mode="abort"),
        WaitIdle(timeout_s=idle_timeout_s),
        ReleaseMemory(tags=_check_tags(release_tags)),
    )


def plan_workload_drain(*, idle_timeout_s: float = 60.0) -> tuple[Step, ...]:
    """Donor side of a workload migration: deactivate and release all memory, so the
    device can be handed to the receiving component."""
    return plan_deactivate(release_tags=MEMORY_TAGS, idle_timeout_s=idle_timeout_s)


def plan_activate(
    *, released_tags: Sequence[str], weights_stale: bool, weights_backed_up: bool = False
) -> tuple[Step, ...]:
    """Hybrid activate: resume ``released_tags`` → sync weights if needed → continue → route.

    Weights are synced when ``weights_stale`` (the trainer moved on) or when ``"weights"``
    was released without a CPU backup (SGLang then gives the memory back undefined).
    """
    steps: list[Step] = []
    if released_tags:
        steps.append(ResumeMemory(tags=_check_tags(released_tags)))
    if weights_stale or ("weights" in released_tags and not weights_backed_up):
        steps.append(SyncWeights())
    steps += [Continue(), AddToRouting()]
    return tuple(steps)


async def execute_steps(
    steps: Sequence[Step],
    *,
    engine: EngineControl,
    router: Router | None = None,
    sync_weights: WeightSyncer | None = None,
) -> None:
    """Carry out ``steps`` in order on ``engine``; stops at the first failure (raised).

    Raises ValueError before doing anything if a step needs a router or a weight syncer that
    was not given.
    """
    if router is None and any(isinstance(s, RemoveFromRouting | AddToRouting) for s in steps):
        raise ValueError("these steps change routing but no router was given")
    if sync_weights is None and any(isinstance(s, SyncWeights) for s in steps):
        raise ValueError("these steps sync weights but no weight syncer was given")
    for step in steps:
        logger.info("engine %s: %s", engine.engine_id, step)
        match step:
            case RemoveFromRouting():
                assert router is not None
                router.remove_engine(engine.engine_id)
            case AddToRouting():
                assert router is not None
                router.add_engine(engine.engine_id)
            case Pause(mode=mode):
                await engine.pause(mode)
            case Continue():
                await engine.continue_generation()
            case WaitIdle(timeout_s=timeout_s):
                await engine.wait_idle(timeout_s=timeout_s)
            case ReleaseMemory(tags=tags):
                await engine.release_memory(tags)
            case ResumeMemory(tags=tags):
                await engine.resume_memory(tags)
            case SyncWeights():
                assert sync_weights is not None
                await sync_weights(engine.engine_id)
