"""``python -m dynarl.runtime.worker``: the entry point of one worker process.

Started by the local launcher (flags) or under torchrun (``RANK`` and ``DYNARL_*``
variables): imports torch and the role modules first, then registers with the controller
and serves until told to leave (see :class:`~dynarl.runtime.worker.WorkerAgent`).
Heartbeats are the controller's (adopted at registration); the loss of the controller
ends the process with status 1.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from dynarl.runtime.worker._options import WorkerOptions

__all__ = ["main", "run_worker"]

logger = logging.getLogger(__name__)


def run_worker(options: WorkerOptions) -> int:
    """Import what the worker needs, then serve; returns the exit status.

    Raises DeadlineExceeded or ProtocolError if the controller refuses or never answers.
    """
    if options.cpus:  # first: torch's threads and every process started later inherit it
        os.sched_setaffinity(0, options.cpus)
    import torch

    torch.set_num_threads(options.num_threads)
    for module in options.preload:
        importlib.import_module(module)
    from dynarl.bus import CurveClient, load_public_key, run
    from dynarl.runtime.worker._agent import WorkerAgent

    curve = None
    if options.key_file:
        server_key = load_public_key(options.server_key_file)
        curve = CurveClient(key_file=Path(options.key_file), server_key=server_key)
    return run(WorkerAgent(options, curve=curve).run())


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line (see :meth:`WorkerOptions.from_args`) and run the worker."""
    options = WorkerOptions.from_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=os.environ.get("DYNARL_LOG_LEVEL", "WARNING").upper(),
        format=f"%(asctime)s worker/{options.device} %(levelname)s %(name)s: %(message)s",
    )
    return run_worker(options)
