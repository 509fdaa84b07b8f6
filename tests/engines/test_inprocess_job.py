"""An in-process vLLM engine under a job (markers ``engines`` and ``slow``): the rollout's
worker runs vLLM's ``AsyncLLM`` itself (``EngineSetup(mode="inprocess")``), not a server.

The worker builds the engine while the job starts (tens of seconds, in a thread: the
worker's loop keeps answering the controller), serves greedy requests whose samples carry
their log-probs and weight version, scores them through an inference component on a
second in-process engine, and when the job ends nothing of either engine is left running.
Behaviour only; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import psutil
import pytest
from vllm_support import WAIT_S, prompt

from dynarl.backends.serving import EngineInference, EngineRollout, EngineSetup
from dynarl.backends.vllm import missing_vllm
from dynarl.bus import GenerationRequest, Sample, pack_tokens, unpack_floats, unpack_tokens
from dynarl.runtime import FINISH, VERSIONS, ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.runtime._worker_protocol import decode_versions
from dynarl.sched import SchedulerConfig

pytestmark = [pytest.mark.engines, pytest.mark.slow]


def setup(model: Path, logs: Path) -> EngineSetup:
    return EngineSetup(
        kind="vllm",
        mode="inprocess",
        ignore_eos=True,
        model=str(model),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=4,
        cpu_kvcache_space_gib=1,
        omp_num_threads=1,
        env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        log_dir=str(logs),
        startup_timeout_s=WAIT_S,
        metrics_interval_s=0.2,
    )


def test_an_inprocess_engine_serves_and_scores_under_a_job(
    tiny_model: Path, tmp_path: Path
) -> None:
    reason = missing_vllm(sys.executable)
    if reason is not None:
        pytest.skip(f"the in-process engine needs vLLM in the workers' interpreter: {reason}")
    options = setup(tiny_model, tmp_path / "engines").to_options()
    specs = [
        ComponentSpec(role=EngineRollout, devices=(0,), options=options),
        ComponentSpec(role=EngineInference, devices=(1,), options=options),
    ]
    runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True), lease_s=60.0)
    config = JobConfig(run_dir=str(tmp_path / "run"), runtime=runtime)
    requests = [
        GenerationRequest(
            sample_id=f"s{i}",
            token_ids=pack_tokens(prompt(12, 300 + i)),
            max_new_tokens=16,
            temperature=0.0,
        )
        for i in range(4)
    ]

    async def collect(job: Job, component: str) -> dict[str, Sample]:
        out = job.output(component)
        got: dict[str, Sample] = {}
        while len(got) < len(requests):
            sample = await out.get()
            got[sample.sample_id] = sample
        return got

    async def main() -> tuple[dict[str, Sample], dict[str, Sample], set[int]]:
        async with asyncio.timeout(4 * WAIT_S), Job(specs, config) as job:
            workers = [psutil.Process(pid) for pid in job.workers().values()]
            engines = {p.pid for w in workers for p in w.children(recursive=True)}
            assert engines, "the workers started no engine process"
            assert not any("api_server" in " ".join(p.cmdline()) for w in workers
                           for p in w.children(recursive=True))  # fmt: skip
            job.submit("rollout", requests)
            generated = await collect(job, "rollout")
            job.submit("inference", list(generated.values()))
            return generated, await collect(job, "inference"), engines

    generated, scored, engines = asyncio.run(main())
    for sample_id, sample in generated.items():
        assert sample.metadata[FINISH] == "length"
        tokens = list(unpack_tokens(sample.token_ids))
        assert len(tokens) == 12 + 16
        assert decode_versions(sample.metadata[VERSIONS]) == [0] * 16
        logprobs = list(unpack_floats(sample.logprobs))
        scores = list(unpack_floats(scored[sample_id].logprobs))
        assert len(scores) == len(tokens) - 1
        # Scored on the other device's engine: the same weights give the same log-probs.
        assert scores[11:] == pytest.approx(logprobs, abs=1e-4)
    assert asyncio.run(all_gone(engines)), "an engine process outlived the job"


async def all_gone(pids: set[int]) -> bool:
    """Whether every process of ``pids`` has ended, waiting a bounded time (a child's exit
    follows its parent's by a moment)."""
    for _ in range(100):
        if not [pid for pid in pids if running(pid)]:
            return True
        await asyncio.sleep(0.1)
    return False


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
