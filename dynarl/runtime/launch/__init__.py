"""Starting a job's processes: who starts the workers (:class:`WorkerLauncher`; the
:class:`LocalLauncher` on this machine), the rendezvous over the job's TCPStore, and the
torchrun entry point ``python -m dynarl.runtime.launch --job module:JOB`` that runs a
:class:`~dynarl.runtime.JobSpec` with the controller on rank 0 and a worker on every rank.
"""

from __future__ import annotations

from dynarl.runtime.launch._launcher import WorkerLauncher
from dynarl.runtime.launch._local import LocalLauncher

__all__ = ["LocalLauncher", "WorkerLauncher"]
