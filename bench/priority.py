"""Request priority on a real engine, step 1: verified cache pressure (issue 20).

A seeded multi-turn agentic trace (``dynarl.sim.agentic_trace``: turns, output lengths with
EOS ignored, tool latencies, observations; prompts and observations spanning several of the
CPU backend's 128-token blocks) is replayed through a ``dynarl.Job`` on one real vLLM server
(``dynarl.demo._agent_replay``): the runtime's dispatcher holds the queue (FIFO here) and
admits up to ``max_num_seqs`` requests; the engine's own queue stays empty. The trace runs
twice on the same tiny random Llama:

- **pressure**: a KV cache of ``--kv-blocks`` blocks (``--num-gpu-blocks-override``), small
  enough to evict;
- **control**: the same trace with ample KV (1 GiB, ~500k tokens).

The pressure run is accepted only if its KV use reached 95% (polled every 50 ms from
``/metrics``), the engine preempted (``vllm:num_preemptions_total`` grew) and its prefix hit
rate is below the control's. Prints both runs, then one JSON line (last) with, per run,
``iteration_s``, ``hit_rate``, ``reprefill_tokens``, ``kv_peak``, ``preemptions``,
``wait_p50_s``/``wait_p99_s``/``wait_max_s``, and ``pressure_verified``. The policies
(DynaRL's key, PLAS, C-MLFQ) and their noise come next (issue 20, points 2-4).

    .venv/bin/python bench/priority.py [--episodes N] [--kv-blocks N] [--seed N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynarl.backends.serving import EngineRollout, EngineSetup
from dynarl.backends.vllm import VLLMClient, VLLMClientConfig, VLLMServer, VLLMServerConfig
from dynarl.demo._agent_replay import ReplayReport, replay_trace
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import FifoPolicy, SchedulerConfig
from dynarl.sim import AgenticSpec, BatchSpec, IterationTrace, LengthSpec, agentic_trace
from dynarl.testing._tiny_llama import write_tiny_llama

VOCAB = 380
"""Token ids drawn below the tiny model's two special tokens."""
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 1536


def trace(num_prompts: int, group_size: int, seed: int) -> IterationTrace:
    """The bench's trace: 300-token prompts shared by a group, 3 tool calls on average,
    150-token observations, turns of ~64 tokens shrinking by 0.8 per turn."""
    return agentic_trace(
        seed=seed,
        batch=BatchSpec(
            num_prompts=num_prompts, group_size=group_size, num_minibatches=1,
            max_seq_len=MAX_MODEL_LEN,
        ),
        lengths=LengthSpec(prompt_median=300, prompt_sigma=0.3, output_median=64,
                           output_sigma=0.5),
        agentic=AgenticSpec(
            mean_tool_calls=3.0, max_tool_calls=6, turn_decay=0.8,
            tool_latency_median_s=0.3, tool_latency_sigma=1.0, tool_timeout_s=5.0,
            observation_median=150, observation_sigma=0.4,
        ),
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One replay with the engine's counters over it."""

    report: ReplayReport
    kv_peak: float
    preemptions: int
    engine_hit_rate: float

    def figures(self) -> dict[str, Any]:
        waits = sorted(self.report.waits_s)
        return {
            "iteration_s": round(self.report.wall_s, 3),
            "hit_rate": round(self.report.hit_rate, 4),
            "engine_hit_rate": round(self.engine_hit_rate, 4),
            "reprefill_tokens": self.report.reprefill_tokens,
            "kv_peak": round(self.kv_peak, 4),
            "preemptions": self.preemptions,
            "turns": len(self.report.turns),
            "wait_p50_s": round(statistics.median(waits), 3),
            "wait_p99_s": round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 3),
            "wait_max_s": round(waits[-1], 3),
        }


async def run_once(model: Path, work: Path, kv_blocks: int | None, it: IterationTrace) -> Run:
    """Start a server (``kv_blocks`` or ample KV), replay ``it`` through a job, stop."""
    config = VLLMServerConfig(
        model=str(model), python=sys.executable, dtype="float32", enforce_eager=True,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
        num_gpu_blocks_override=kv_blocks, cpu_kvcache_space_gib=1,
        cpu_omp_threads_bind="nobind", omp_num_threads=1,
        env=(("HF_HUB_OFFLINE", "1"),), log_dir=str(work / "logs"), startup_timeout_s=600,
    )  # fmt: skip
    async with VLLMServer(config) as server:
        client = VLLMClient(VLLMClientConfig(base_url=server.url))
        async with client:
            before = await client.load()
            peak = [0.0]

            async def poll() -> None:
                while True:
                    peak[0] = max(peak[0], (await client.load()).kv_cache_usage)
                    await asyncio.sleep(0.05)

            setup = EngineSetup(urls={"0": server.url}, max_num_seqs=MAX_NUM_SEQS, ignore_eos=True)
            spec = ComponentSpec(
                role=EngineRollout, devices=(0,), options=setup.to_options(),
                max_inflight=MAX_NUM_SEQS, request_policy=FifoPolicy(),
            )  # fmt: skip
            runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True))
            job_config = JobConfig(num_devices=1, run_dir=str(work / "job"), runtime=runtime)
            async with Job([spec], job_config) as job, asyncio.TaskGroup() as group:
                poller = group.create_task(poll())
                try:
                    report = await replay_trace(job, it, vocab=VOCAB)
                finally:
                    poller.cancel()
            after = await client.load()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return Run(
        report=report,
        kv_peak=peak[0],
        preemptions=after.num_preemptions - before.num_preemptions,
        engine_hit_rate=hits / queries if queries else 0.0,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=32, help="episodes (groups of 4)")
    parser.add_argument("--kv-blocks", type=int, default=16, help="pressure run's KV blocks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    it = trace(max(1, args.episodes // 4), 4, args.seed)
    with tempfile.TemporaryDirectory(prefix="dynarl-priority-") as tmp:
        work = Path(tmp)
        model = write_tiny_llama(work / "model", seed=0, max_position_embeddings=MAX_MODEL_LEN)
        pressure = asyncio.run(run_once(model, work / "pressure", args.kv_blocks, it))
        control = asyncio.run(run_once(model, work / "control", None, it))
    figures = {"pressure": pressure.figures(), "control": control.figures()}
    for name, values in figures.items():
        print(f"{name:>9}: " + "  ".join(f"{k} {v}" for k, v in values.items()))
    verified = (
        pressure.kv_peak >= 0.95
        and pressure.preemptions > 0
        and pressure.report.hit_rate < control.report.hit_rate
    )
    figures["pressure_verified"] = verified  # type: ignore[assignment]
    figures["kv_blocks"] = args.kv_blocks  # type: ignore[assignment]
    figures["episodes"] = it.num_samples  # type: ignore[assignment]
    figures["turns_in_trace"] = int(it.turn_start[-1])  # type: ignore[assignment]
    sys.stdout.flush()
    print(json.dumps(figures))
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
