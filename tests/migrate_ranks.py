"""Spawn ranks for the migrate multi-process tests: loopback, results by rank, no leaks."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

RankFn = Callable[..., Any]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(fn: RankFn, rank: int, world: int, port: int, out: Any, args: tuple[Any, ...]) -> None:
    try:
        out.put((rank, True, fn(rank, world, port, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: RankFn, world: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world, port, *args)`` in ``world`` spawned processes; results by rank.

    Raises AssertionError with the failing rank's traceback; terminates (by pid) any process
    still alive at the end.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out, args)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world):
            try:
                rank, ok, value = out.get(timeout=timeout_s)
            except queue.Empty:
                failures.append(f"timed out after {timeout_s} s waiting for a rank")
                break
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not failures else 1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        out.close()
        out.join_thread()
    assert not failures, "\n".join(failures)
    return [results[r] for r in range(world)]
