"""The worker process: one per device, hosting the job's roles and answering the controller.

``python -m dynarl.runtime.worker`` is its entry point (the local launcher and torchrun
start it).
"""

from __future__ import annotations

from dynarl.runtime.worker._agent import WorkerAgent
from dynarl.runtime.worker._entry import prepare_process
from dynarl.runtime.worker._options import WorkerOptions
from dynarl.runtime.worker._role import (
    Checkpointing,
    ComputeThread,
    Reporting,
    Reshardable,
    RoleContext,
    RoleMetrics,
    Serving,
    role_path,
)

__all__ = [
    "Checkpointing",
    "ComputeThread",
    "Reporting",
    "Reshardable",
    "RoleContext",
    "RoleMetrics",
    "Serving",
    "WorkerAgent",
    "WorkerOptions",
    "prepare_process",
    "role_path",
]
