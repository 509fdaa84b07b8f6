"""Real vLLM engines that fail (markers ``engines`` and ``slow``: each case starts servers
of its own, half a minute or more each, so none is in ``make test``).

- An engine that cannot start — a model path that does not exist, a port another socket
  holds, a server killed while it starts — gives a ``BackendError`` naming the engine with
  the tail of its log, and leaves no process behind; through a job, the job's start fails
  with that text.
- An engine killed mid-request under a job's rollout: its worker leaves, the device is
  reclaimed, and every request finishes on the other engine, once, whole.

``tests/dist/test_engine_loss_job.py`` runs the second case on the SGLang fake inside
``make test``. The machine has fewer cores than these tests run servers: they
oversubscribe it and assert nothing about speed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal
import socket
from collections import Counter
from pathlib import Path

import psutil
import pytest
from vllm_support import MAX_NUM_SEQS, WAIT_S, prompt, server_config

from dynarl.backends.serving import EngineRollout, EngineSetup
from dynarl.backends.vllm import VLLMServer
from dynarl.bus import GenerationRequest, Sample, pack_tokens, unpack_tokens
from dynarl.errors import BackendError, DynarlError
from dynarl.runtime import FINISH, ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import SchedulerConfig
from dynarl.testing import TinyTrainer

pytestmark = [pytest.mark.engines, pytest.mark.slow]


def servers_on(port: int) -> list[psutil.Process]:
    """Processes whose command line serves ``port``."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        args = process.info["cmdline"] or []
        if any(a == "--port" and b == str(port) for a, b in itertools.pairwise(args)):
            found.append(process)
    return found


async def start_failing(server: VLLMServer, *, kill_after_s: float | None) -> BackendError:
    """Start ``server``, expecting it to fail; kill its process group first when asked."""
    start = asyncio.create_task(server.start())
    if kill_after_s is not None:
        await asyncio.sleep(kill_after_s)
        assert server.pid is not None and not start.done()
        os.killpg(server.pid, signal.SIGKILL)
    with pytest.raises(BackendError) as failed:
        async with asyncio.timeout(WAIT_S):
            await start
    return failed.value


@pytest.mark.parametrize("case", ["no such model", "port taken", "killed while starting"])
def test_an_engine_that_cannot_start_says_why_and_leaves_no_process(
    case: str, engine_python: str, tiny_model: Path, tmp_path: Path
) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    if case != "port taken":
        holder.close()  # free again: the server may bind it
    model = tmp_path / "no-such-model" if case == "no such model" else tiny_model
    config = server_config(engine_python, model, tmp_path / "logs")
    server = VLLMServer(dataclasses.replace(config, port=port, startup_timeout_s=WAIT_S))
    kill_after_s = 5.0 if case == "killed while starting" else None
    try:
        error = asyncio.run(start_failing(server, kill_after_s=kill_after_s))
    finally:
        holder.close()
    message = str(error)
    assert message.startswith("vLLM server "), message
    assert "log tail:" in message
    expected = {
        "no such model": str(model),
        "port taken": "in use",
        "killed while starting": "killed by SIGKILL",
    }[case]
    assert expected in message, message
    assert servers_on(port) == []


def setup(engine_python: str, model: Path, log_dir: Path) -> EngineSetup:
    return EngineSetup(
        ignore_eos=True,
        model=str(model),
        python=engine_python,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=MAX_NUM_SEQS,
        cpu_kvcache_space_gib=1,
        omp_num_threads=1,
        env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        log_dir=str(log_dir),
        startup_timeout_s=WAIT_S,
        metrics_interval_s=0.2,
    )


def test_a_job_whose_engine_cannot_start_fails_naming_it(
    engine_python: str, tmp_path: Path
) -> None:
    bad = setup(engine_python, tmp_path / "no-such-model", tmp_path / "engines")
    specs = [ComponentSpec(role=EngineRollout, devices=(0,), options=bad.to_options())]
    config = JobConfig(run_dir=str(tmp_path / "run"))

    async def main() -> None:
        async with asyncio.timeout(WAIT_S), Job(specs, config):
            pytest.fail("the job started without its engine")

    with pytest.raises(DynarlError) as failed:
        asyncio.run(main())
    assert "vLLM server" in str(failed.value) and str(tmp_path / "no-such-model") in str(
        failed.value
    ), failed.value


def test_a_killed_engine_takes_its_worker_out_and_its_requests_finish_elsewhere(
    engine_python: str, tiny_model: Path, tmp_path: Path
) -> None:
    options = setup(engine_python, tiny_model, tmp_path / "engines").to_options()
    specs = [
        ComponentSpec(role=EngineRollout, devices=(0, 1), options=options, max_inflight=2),
        ComponentSpec(role=TinyTrainer, devices=(2,)),
    ]
    runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True), lease_s=60.0)
    config = JobConfig(run_dir=str(tmp_path / "run"), runtime=runtime)
    requests = [
        GenerationRequest(
            sample_id=f"s{i}",
            token_ids=pack_tokens(prompt(12, 200 + i)),
            max_new_tokens=400,
            temperature=0.0,
        )
        for i in range(6)
    ]

    async def main() -> list[Sample]:
        async with asyncio.timeout(2 * WAIT_S), Job(specs, config) as job:
            job.submit("rollout", requests)
            worker = psutil.Process(job.workers()[1])
            (server,) = [
                p for p in worker.children(recursive=True) if "api_server" in " ".join(p.cmdline())
            ]
            await asyncio.sleep(3.0)  # requests running on both engines
            os.killpg(server.pid, signal.SIGKILL)
            out = job.output("rollout")
            samples = [await out.get(timeout=WAIT_S) for _ in requests]
            losses = job.controller.link.losses
            assert set(losses.lost) == {1} and 1 in losses.reclaimed
            assert job.allocation.as_dict()["rollout"] == [0]
            return samples

    samples = asyncio.run(main())
    assert Counter(s.sample_id for s in samples) == Counter(r.sample_id for r in requests)
    for sample in samples:
        assert sample.metadata[FINISH] == "length", sample.metadata
        assert len(unpack_tokens(sample.token_ids)) == sample.prompt_len + 400
