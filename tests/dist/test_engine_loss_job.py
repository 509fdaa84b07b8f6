"""Real engine servers under a job's serving role (marker ``dist``): an engine that dies
takes its worker out and the job goes on; with pinning, each worker and its engine run on
the worker's own core.

The rollout is :class:`~dynarl.backends.serving.EngineRollout` on devices 0 and 1, each
launching its own engine server as a process: here the SGLang fake
(``dynarl.testing.sglang_fake``, a real HTTP server in its own process group, fast to
start; ``tests/engines/test_engine_faults.py`` does the same with real vLLM servers under
``slow``). Device 1's server is SIGKILLed while requests run on it. Its worker sees the
engine gone (``EngineLostError``), leaves the job with status 3, the controller records
the loss and reclaims the device, and every request continues on device 0: each sample
delivered exactly once, none failed, each equal to an uninterrupted generation of the same
request (the fake's tokens are a function of the context). Pinned (``pin_cores``), the
workers of devices 0 and 1 and their servers run on this process's first and second core,
and the job writes each core's busy time to ``cores.json``. Bounded by timeouts; no timing
is asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import msgspec
import psutil
import pytest

from dynarl.backends.serving import EngineRollout, EngineSetup
from dynarl.bus import GenerationRequest, Sample, pack_tokens, unpack_tokens
from dynarl.runtime import FINISH, ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import SchedulerConfig
from dynarl.testing import TinyTrainer

pytestmark = pytest.mark.dist

NUM = 8
MAX_NEW = 120
FAKE = "dynarl.testing.sglang_fake"


def setup(tmp_path: Path) -> EngineSetup:
    return EngineSetup(
        kind="sglang",
        model="fake-model",
        module=FAKE,
        # ~20 ms a decoding step: a request runs for seconds, so some are on device 1.
        extra_args=("--fake-step-interval", "0.02"),
        log_dir=str(tmp_path / "engines"),
        startup_timeout_s=60.0,
        metrics_interval_s=0.1,
    )


def requests() -> list[GenerationRequest]:
    return [
        GenerationRequest(
            sample_id=f"s{i}", token_ids=pack_tokens([3, i, 5]), max_new_tokens=MAX_NEW, seed=i
        )
        for i in range(NUM)
    ]


def engine_server_of(worker_pid: int) -> psutil.Process:
    """The fake engine server the worker process launched."""
    (server,) = [
        child
        for child in psutil.Process(worker_pid).children(recursive=True)
        if FAKE in " ".join(child.cmdline())
    ]
    return server


async def collect(job: Job, num: int) -> dict[str, Sample]:
    out = job.output("rollout")
    got: dict[str, Sample] = {}
    while len(got) < num:
        sample = await out.get()
        assert sample.sample_id not in got, f"{sample.sample_id} delivered twice"
        got[sample.sample_id] = sample
    return got


def test_a_killed_engine_takes_its_worker_out_and_its_requests_finish_elsewhere(
    tmp_path: Path,
) -> None:
    specs = [
        ComponentSpec(role=EngineRollout, devices=(0, 1), options=setup(tmp_path).to_options()),
        ComponentSpec(role=TinyTrainer, devices=(2,), options={"hidden": 8, "num_layers": 1}),
    ]
    runtime = RuntimeConfig(
        scheduler=SchedulerConfig(observe_only=True), request_timeout_s=30.0, lease_s=40.0
    )
    config = JobConfig(run_dir=str(tmp_path / "run"), runtime=runtime)

    async def main() -> None:
        async with asyncio.timeout(240), Job(specs, config) as job:
            # An uninterrupted run of every request first (both engines alive).
            job.submit("rollout", requests())
            whole = await collect(job, NUM)
            server = engine_server_of(job.workers()[1])
            again = [
                msgspec.structs.replace(r, sample_id=f"again-{r.sample_id}") for r in requests()
            ]
            job.submit("rollout", again)
            await asyncio.sleep(1.0)  # requests in flight on both engines
            os.killpg(server.pid, signal.SIGKILL)
            got = await collect(job, NUM)
            for request in requests():
                sample = got[f"again-{request.sample_id}"]
                assert sample.metadata[FINISH] == "length", sample.metadata
                assert list(unpack_tokens(sample.token_ids)) == list(
                    unpack_tokens(whole[request.sample_id].token_ids)
                )
            losses = job.controller.link.losses
            assert set(losses.lost) == {1} and 1 in losses.reclaimed
            # Judged from its exit status, or from its leaving if the controller heard that
            # first.
            cause = losses.lost[1].cause
            assert cause == "exited with status 3" or cause.startswith(
                "left the job (its engine died: rollout on device 1: engine sglang@"
            ), cause
            assert job.allocation.as_dict()["rollout"] == [0]

    asyncio.run(main())


@pytest.mark.slow  # ~20 s; tests/unit/test_cores.py checks the pinning rules in make test
def test_a_pinned_job_runs_each_worker_and_its_engine_on_its_own_core(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"pinning two devices needs two cores; this process may use {cores}")
    specs = [
        ComponentSpec(role=EngineRollout, devices=(0, 1), options=setup(tmp_path).to_options())
    ]
    runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True), pin_cores=True)
    config = JobConfig(run_dir=str(tmp_path / "run"), runtime=runtime)

    async def main() -> dict[int, tuple[set[int], set[int]]]:
        async with asyncio.timeout(240), Job(specs, config) as job:
            job.submit("rollout", requests()[:4])
            await collect(job, 4)
            placed = {}
            for device, pid in job.workers().items():
                server = engine_server_of(pid)
                engine = {core for p in [server, *server.children(recursive=True)]
                          for core in p.cpu_affinity()}  # fmt: skip
                placed[device] = (os.sched_getaffinity(pid), engine)
            usage = job.core_usage()
            assert usage.devices == {0: cores[0], 1: cores[1]}
            assert set(usage.busy_s) >= set(cores) and usage.wall_s > 0
            return placed

    placed = asyncio.run(main())
    assert placed == {0: ({cores[0]}, {cores[0]}), 1: ({cores[1]}, {cores[1]})}
    written = json.loads((tmp_path / "run" / "cores.json").read_text())
    assert written["pinned"] == {"0": cores[0], "1": cores[1]}
    assert {str(c) for c in cores} <= set(written["cores"])
