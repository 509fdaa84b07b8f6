"""Devices are cores on real vLLM engines (marker ``engines``).

The package's two servers run one per core (``VLLMServerConfig.cpus``, what a pinned job's
roles give their engines): every process of each runs on its core only, and its OpenMP
threads are bound there. A paused engine — requests frozen in place mid-generation —
spends next to no CPU, read from ``/proc`` over a window (a bound on CPU seconds, not on
speed).
"""

from __future__ import annotations

import asyncio
import os

import psutil
import pytest
from vllm_support import WAIT_S, greedy_request

from dynarl.backends.vllm import VLLMEngine, VLLMServer
from dynarl.runtime._cores import process_cpu_seconds

pytestmark = pytest.mark.engines

WINDOW_S = 2.0
SETTLE_S = 2.0
PAUSED_CPU_SHARE = 0.1
"""At most this share of one core while paused (measured here: 0.02 to 0.05 s over 2 s)."""


def group(server: VLLMServer) -> list[psutil.Process]:
    """The server's process and every process it started."""
    assert server.pid is not None
    leader = psutil.Process(server.pid)
    return [leader, *leader.children(recursive=True)]


def test_each_engine_runs_on_its_own_core(
    vllm_server: VLLMServer, vllm_server_b: VLLMServer
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"one engine per core needs two cores; this process may use {cores}")
    for server, core in ((vllm_server, cores[0]), (vllm_server_b, cores[1])):
        processes = group(server)
        assert len(processes) >= 2  # the API server and its engine core at least
        assert {p.pid: set(p.cpu_affinity()) for p in processes} == {
            p.pid: {core} for p in processes
        }
        # What binds the engine's OpenMP threads (its engine processes read it at start).
        assert processes[0].environ().get("VLLM_CPU_OMP_THREADS_BIND") == str(core)


def test_a_paused_engine_spends_next_to_no_cpu(vllm_server: VLLMServer) -> None:
    async def main() -> tuple[float, float]:
        engine = VLLMEngine(url=vllm_server.url)
        await engine.start()
        pids = [p.pid for p in group(vllm_server)]
        running = asyncio.create_task(engine.generate(greedy_request("frozen", 900, 3)))
        try:
            for _ in range(int(WAIT_S / 0.02)):  # bounded
                if (await engine.load()).running >= 1:
                    break
                await asyncio.sleep(0.02)
            busy = await cpu_over_window(pids)
            await engine.pause("keep")
            # The step in progress ends, and OpenMP's threads stop spinning: measured here,
            # the first second after a pause still spent ~0.3 s of CPU, the next ones ~0.02.
            await asyncio.sleep(SETTLE_S)
            paused = await cpu_over_window(pids)
            assert not running.done()  # frozen, not finished
        finally:
            await engine.resume()
            await engine.abort_all()
            await asyncio.gather(running, return_exceptions=True)
            await engine.aclose()
        return busy, paused

    busy, paused = asyncio.run(main())
    assert paused <= PAUSED_CPU_SHARE * WINDOW_S, (busy, paused)
    assert busy > paused, (busy, paused)


async def cpu_over_window(pids: list[int]) -> float:
    """CPU seconds ``pids`` spend over :data:`WINDOW_S`."""
    before = process_cpu_seconds(pids)
    await asyncio.sleep(WINDOW_S)
    return process_cpu_seconds(pids) - before
