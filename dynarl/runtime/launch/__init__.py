"""Starting a job's processes: the local launcher, the rendezvous over the job's TCPStore,
and the torchrun entry point ``python -m dynarl.runtime.launch``.
"""

from __future__ import annotations

from dynarl.runtime.launch._local import LocalLauncher
from dynarl.runtime.launch._torchrun import ControllerContext, LaunchedJob, WorkerContext

__all__ = ["ControllerContext", "LaunchedJob", "LocalLauncher", "WorkerContext"]
