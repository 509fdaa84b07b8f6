"""Soak of the running system (marker ``slow``; DYNARL_SOAK_S seconds, 600 by default):
the durable job of :mod:`fault_loop` trains a step every DYNARL_SOAK_STEP_S seconds (1 by
default) and moves device 1 between the rollout and the trainer every DYNARL_SOAK_MOVE_S
seconds (3 by default: a workload migration plus a P2P reshard), with a checkpoint every
five steps. After the warm-up the
whole process tree (controller and workers) must grow by less than 1 MB/min, and file
descriptors, sockets, processes and process groups must not grow while it runs (sampled
on the starting allocation); once the job is closed they are all back at their baseline
from before it started. With DYNARL_SOAK_TRACE=DIR the Python allocations of the test
process and the workers are traced (:mod:`soak_trace`) from the end of the warm-up on:
snapshots half-way and at the end, compared by traceback in DIR/report.txt (with
DYNARL_SOAK_TRACE_MODE=malloc: glibc's heap in use and free, per process). The log
names each process's RSS growth.

    DYNARL_SOAK_S=120 .venv/bin/python -m pytest -m slow tests/soak/test_migration_soak.py \\
        -o log_cli=true --log-cli-level=WARNING
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import fault_loop
import pytest
from soak_support import (
    ResourceProbe,
    ResourceSample,
    growth_by_process,
    leaks,
    memory_growth_per_min,
)
from soak_trace import memory_trace
from torch._C._distributed_c10d import TCPStore

from dynarl.runtime._durable_run import DurableConfig, DurableRun
from dynarl.runtime.durable._manifest import ManifestConfig

pytestmark = pytest.mark.slow

DURATION_S = float(os.environ.get("DYNARL_SOAK_S", "600"))
MOVE_S = float(os.environ.get("DYNARL_SOAK_MOVE_S", "3"))
STEP_S = float(os.environ.get("DYNARL_SOAK_STEP_S", "1"))


@pytest.mark.timeout(DURATION_S + 400)
def test_migrations_every_few_seconds_do_not_grow(tmp_path: Path) -> None:
    # torch keeps a pipe pair for the life of a process from its first TCPStore server on:
    # create one before the baseline, so that what the baseline misses is the job's.
    timeout = timedelta(seconds=5)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    del store
    probe = ResourceProbe()
    baseline = probe.sample()
    trace = memory_trace()
    samples: list[ResourceSample] = []
    moves: list[bool] = []

    async def main() -> tuple[ResourceSample, ResourceSample, int]:
        async with fault_loop.job(tmp_path) as job:
            config = DurableConfig(
                source=fault_loop.SOURCE, checkpoint_every=5, max_tokens=fault_loop.MAX_NEW,
                manifest=ManifestConfig(num_digests_kept=100),
            )  # fmt: skip
            run = await DurableRun(job, config).open()
            began = moved = time.monotonic()
            every = DURATION_S / 60
            next_sample = began
            warm: ResourceSample | None = None
            while time.monotonic() - began < DURATION_S:
                paced = asyncio.create_task(asyncio.sleep(STEP_S))
                tickets = fault_loop.submit(job, run)
                if time.monotonic() - moved >= MOVE_S:
                    give = 1 in job.allocation.devices("rollout")
                    src, dst = ("rollout", "trainer") if give else ("trainer", "rollout")
                    moves.append((await job.move([1], src=src, dst=dst)).ok)
                    moved = time.monotonic()
                await run.train(await fault_loop.collect(job, tickets))
                await paced
                # Sampled on one allocation only: the trainer's groups differ between the two.
                if time.monotonic() >= next_sample and job.allocation == fault_loop.BASE:
                    samples.append(probe.sample())
                    next_sample += every
                    if warm is None and time.monotonic() - began >= DURATION_S / 5:
                        warm = samples[-1]
                    if trace is not None and len(samples) in (12, 30):
                        trace.take(samples[-1].pids)  # start tracing, first snapshot
            assert warm is not None
            if trace is not None:
                trace.take(probe.sample().pids)
                await asyncio.sleep(5.0)
            report = run.report()
            assert report.ok, report.violations[:5]
            if job.allocation != fault_loop.BASE:
                await job.move([1], src="trainer", dst="rollout")
            return warm, probe.sample(), run.step

    warm, last, steps = asyncio.run(main())
    final = probe.sample()
    growth = memory_growth_per_min([*samples, last], warmup_s=DURATION_S / 5)
    logging.getLogger(__name__).warning(
        "%d steps, %d migrations (%d committed) in %.0f s: RSS growth %.0f B/min after "
        "warm-up; fds %d -> %d, sockets %d -> %d while running",
        steps, len(moves), sum(moves), DURATION_S, growth, warm.num_fds, last.num_fds,
        warm.num_sockets, last.num_sockets,
    )  # fmt: skip
    per_process = growth_by_process([*samples, last], warmup_s=DURATION_S / 5)
    logging.getLogger(__name__).warning(
        "RSS growth by process after warm-up (B/min; the first pid is this process): %s",
        {pid: round(rate) for pid, rate in per_process.items()},
    )
    if trace is not None:
        logging.getLogger(__name__).warning("allocations:\n%s", trace.report(samples))
    assert all(moves), "a migration failed"
    assert growth < 1024 * 1024, growth
    running = leaks(warm, last)
    assert running == [], running
    assert leaks(baseline, final) == []
