"""dynarl: a dynamic scheduler inside RL post-training jobs.

The public surface users touch directly is re-exported here; each package
(``dynarl.bus``, ``dynarl.sched``, ``dynarl.migrate``, ``dynarl.sim``, ``dynarl.runtime``,
``dynarl.backends``) exports its own with ``__all__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynarl.bus import Channel, WorkerGroup
from dynarl.errors import (
    BackendError,
    BusError,
    DeadlineExceeded,
    DynarlError,
    EngineLostError,
    IntegrityError,
    LeaseExpiredError,
    MigrationAborted,
    MigrationError,
    PeerLostError,
    ProtocolError,
    RemoteError,
    SchedulingError,
    WorkerError,
    WorkerLostError,
)
from dynarl.types import Allocation, ComponentKind, MigrationKind, ParallelDims

if TYPE_CHECKING:
    from dynarl.runtime import ComponentSpec, Job, JobConfig, JobSpec, RuntimeConfig

__version__ = "0.1.0"

__all__ = [
    "Allocation",
    "BackendError",
    "BusError",
    "Channel",
    "ComponentKind",
    "ComponentSpec",
    "DeadlineExceeded",
    "DynarlError",
    "EngineLostError",
    "IntegrityError",
    "Job",
    "JobConfig",
    "JobSpec",
    "LeaseExpiredError",
    "MigrationAborted",
    "MigrationError",
    "MigrationKind",
    "ParallelDims",
    "PeerLostError",
    "ProtocolError",
    "RemoteError",
    "RuntimeConfig",
    "SchedulingError",
    "WorkerError",
    "WorkerGroup",
    "WorkerLostError",
]

_RUNTIME = frozenset({"ComponentSpec", "Job", "JobConfig", "JobSpec", "RuntimeConfig"})


def __getattr__(name: str) -> Any:
    # The runtime imports torch: loaded on first use, not by ``import dynarl``.
    if name in _RUNTIME:
        from dynarl import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # ``dir(dynarl)`` lists the lazily imported runtime names too, without importing them.
    return sorted(set(globals()) | _RUNTIME)
