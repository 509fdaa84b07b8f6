"""``python -m dynarl.runtime.worker``: the entry point of one worker process.

Started by the local launcher (flags) or under torchrun (``RANK`` and ``DYNARL_*``
variables): imports torch and the role modules first, then registers with the controller
and serves until told to leave (see :class:`~dynarl.runtime.worker.WorkerAgent`).
Heartbeats are the controller's (adopted at registration); the loss of the controller
ends the process with status 1.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from dynarl.runtime.worker._options import WorkerOptions

__all__ = ["main", "prepare_process", "run_worker"]

logger = logging.getLogger(__name__)


def prepare_process(options: WorkerOptions) -> None:
    """What a worker process does before it serves (launched either way): torch's
    threads, the role modules, then the garbage collector told to leave what the imports
    made alone.

    What the imports made lives as long as the process. Frozen out of the collector's
    sight, it no longer costs the collections that free a torn-down role or a closed
    migration at once (their process groups, sockets and buffers often hang on reference
    cycles): microseconds instead of a quarter of a second.
    """
    import torch

    torch.set_num_threads(options.num_threads)
    for module in options.preload:
        importlib.import_module(module)
    gc.collect()
    gc.freeze()


def run_worker(options: WorkerOptions) -> int:
    """Import what the worker needs, then serve; returns the exit status.

    Raises DeadlineExceeded or ProtocolError if the controller refuses or never answers.
    """
    if options.cpus:  # first: torch's threads and every process started later inherit it
        os.sched_setaffinity(0, options.cpus)
    prepare_process(options)
    from dynarl.bus import CurveClient, load_public_key, run
    from dynarl.runtime.worker._agent import WorkerAgent

    curve = None
    if options.key_file:
        server_key = load_public_key(options.server_key_file)
        curve = CurveClient(key_file=Path(options.key_file), server_key=server_key)
    try:
        return run(WorkerAgent(options, curve=curve).run())
    finally:
        gc.unfreeze()  # interpreter shutdown then finalises them as usual


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line (see :meth:`WorkerOptions.from_args`) and run the worker."""
    options = WorkerOptions.from_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=os.environ.get("DYNARL_LOG_LEVEL", "WARNING").upper(),
        format=f"%(asctime)s worker/{options.device} %(levelname)s %(name)s: %(message)s",
    )
    return run_worker(options)
