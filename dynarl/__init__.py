"""dynarl: a dynamic scheduler inside RL post-training jobs.

The public surface users touch directly is re-exported here; each package
(``dynarl.bus``, ``dynarl.sched``, ``dynarl.migrate``, ``dynarl.sim``, ``dynarl.runtime``,
``dynarl.backends``) exports its own with ``__all__``.
"""

from __future__ import annotations

from dynarl.bus.channel import Channel
from dynarl.bus.component import WorkerGroup
from dynarl.errors import (
    BackendError,
    BusError,
    DeadlineExceeded,
    DynarlError,
    IntegrityError,
    LeaseExpiredError,
    MigrationAborted,
    MigrationError,
    PeerLostError,
    ProtocolError,
    RemoteError,
    SchedulingError,
    WorkerError,
)
from dynarl.types import Allocation, ComponentKind, MigrationKind, ParallelDims

__version__ = "0.1.0"

__all__ = [
    "Allocation",
    "BackendError",
    "BusError",
    "Channel",
    "ComponentKind",
    "DeadlineExceeded",
    "DynarlError",
    "IntegrityError",
    "LeaseExpiredError",
    "MigrationAborted",
    "MigrationError",
    "MigrationKind",
    "ParallelDims",
    "PeerLostError",
    "ProtocolError",
    "RemoteError",
    "SchedulingError",
    "WorkerError",
    "WorkerGroup",
]
