"""Request priority on a real engine: verified cache pressure, then four policies against their
own noise (issue 20).

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
rate is below the control's.

Then, on the pressure server, the policies — FIFO (twice: an A/A pair whose difference is
the noise floor), DynaRL's key (``PriorityPolicy``: tool calls done, then cached prefix),
PLAS (``LeastAttainedServicePolicy`` over the episode's attained service) and C-MLFQ
(``ToolMlfqPolicy``) — ``--reps`` rounds each, the order rotated every round, the prefix
cache reset before every run, the scheduler observing only (a fixed allocation). Per
policy: medians and spread (min–max) of the iteration time, hit rate, re-prefilled tokens,
preemptions, waits (p50/p99/max) and the most overtakes a request suffered (asserted
``<= max_overtakes``). A gain over FIFO is claimed only above the A/A spread.

The DynaRL key's cached-prefix term comes from the dispatcher's shadow of the engine's
cache (``ComponentSpec.prefix_cache``: 128-token blocks, the engine's KV blocks), checked
against every request's reported ``cached_tokens`` (``shadow_exact``, ``shadow_error``:
the share predicted exactly, the mean error in tokens).

**The simulator against the engine.** On the control server, before any policy run, a
profiling pass (``bench/_vllm_profile.py``: decode step time by batch and KV, prefill
speed, measured through a job as the policies drive the engine) calibrates the simulator's
engine model — vLLM's configuration as a
``RolloutSpec``: the pressure run's KV less vLLM's null block, ``max_num_seqs``, no
reserve for future tokens (vLLM allocates blocks as decoding goes), whole 128-token blocks
reused from the prefix cache — which is frozen and named by its hash
(``sim.model_digest``) before the policies run. ``dynarl.sim.replay_rollout`` then predicts
every policy's iteration time on the same trace (and the control's); the errors are
reported per policy, and ``sim_gain_error`` is the predicted minus the measured gain of
DynaRL's key over FIFO.

Last line, JSON: ``pressure``/``control`` figures, ``pressure_verified``, per policy
``iteration_s``, ``hit_rate``, ``reprefill_tokens``, ``max_overtakes`` (and the rest), and
``aa_noise``, ``priority_gain_over_fifo``, ``sim_gain_error``, and ``sim`` (the model, its
digest, the profile, the predictions and their errors).

    .venv/bin/python bench/priority.py [--episodes N] [--kv-blocks N] [--reps N] [--seed N]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _vllm_profile import profile_engine

from dynarl.backends.serving import EngineRollout, EngineSetup
from dynarl.backends.vllm import VLLMClient, VLLMClientConfig, VLLMServer, VLLMServerConfig
from dynarl.demo._agent_replay import ReplayReport, replay_trace
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import (
    FifoPolicy,
    LeastAttainedServicePolicy,
    PrefixCache,
    PriorityPolicy,
    RequestPolicy,
    SchedulerConfig,
    ToolMlfqPolicy,
)
from dynarl.sim import (
    AgenticSpec,
    BatchSpec,
    EngineProfile,
    IterationTrace,
    LengthSpec,
    RolloutSpec,
    agentic_trace,
    load_workload,
    replay_rollout,
    spec_digest,
)
from dynarl.testing._tiny_llama import write_tiny_llama

VOCAB = 380
"""Token ids drawn below the tiny model's two special tokens."""
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 1536
MAX_OVERTAKES = 64
BLOCK = 128
"""vLLM's CPU backend caches whole blocks of 128 tokens."""
AMPLE_BLOCKS = 4000
"""The control's KV (1 GiB of the tiny model: ~500k tokens), as the shadow sees it."""
POLICIES: dict[str, RequestPolicy] = {
    "fifo": FifoPolicy(),
    "fifo-aa": FifoPolicy(),
    "dynarl": PriorityPolicy(),
    "plas": LeastAttainedServicePolicy(),
    "cmlfq": ToolMlfqPolicy(quantum=64.0, levels=4),
}
"""The runs of one round; ``fifo-aa`` is FIFO again (the A/A pair)."""


def trace(num_prompts: int, group_size: int, seed: int) -> IterationTrace:
    """The bench's trace: 300-token prompts shared by a group, 3 tool calls on average,
    150-token observations, turns of ~64 tokens shrinking by 0.8 per turn."""
    return agentic_trace(
        tool_success_rate=0.7,
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
    max_overtakes: int
    shadow_exact: float
    shadow_error: float

    def figures(self) -> dict[str, Any]:
        waits = sorted(self.report.waits_s)
        return {
            "iteration_s": round(self.report.wall_s, 3),
            "hit_rate": round(self.report.hit_rate, 4),
            "engine_hit_rate": round(self.engine_hit_rate, 4),
            "reprefill_tokens": self.report.reprefill_tokens,
            "kv_peak": round(self.kv_peak, 4),
            "preemptions": self.preemptions,
            "max_overtakes": self.max_overtakes,
            "shadow_exact": round(self.shadow_exact, 4),
            "shadow_error": round(self.shadow_error, 2),
            "turns": len(self.report.turns),
            "wait_p50_s": round(statistics.median(waits), 3),
            "wait_p99_s": round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 3),
            "wait_max_s": round(waits[-1], 3),
        }


def server_config(model: Path, work: Path, kv_blocks: int | None) -> VLLMServerConfig:
    """One engine: ``kv_blocks`` of KV (None: ample), ``MAX_NUM_SEQS`` running."""
    return VLLMServerConfig(
        model=str(model), python=sys.executable, dtype="float32", enforce_eager=True,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
        num_gpu_blocks_override=kv_blocks, cpu_kvcache_space_gib=1,
        cpu_omp_threads_bind="nobind", omp_num_threads=1,
        env=(("HF_HUB_OFFLINE", "1"),), log_dir=str(work / "logs"), startup_timeout_s=600,
    )  # fmt: skip


def rollout_job(server: VLLMServer, work: Path, policy: RequestPolicy, kv_blocks: int) -> Job:
    """A job whose rollout is ``server`` behind the runtime's dispatcher: the queue held and
    ordered by ``policy``, ``MAX_NUM_SEQS`` admitted, a shadow of ``kv_blocks`` blocks, the
    scheduler observing only."""
    setup = EngineSetup(urls={"0": server.url}, max_num_seqs=MAX_NUM_SEQS, ignore_eos=True)
    spec = ComponentSpec(
        role=EngineRollout, devices=(0,), options=setup.to_options(),
        max_inflight=MAX_NUM_SEQS, request_policy=policy, max_overtakes=MAX_OVERTAKES,
        prefix_cache=PrefixCache(block_size=BLOCK, capacity_blocks=kv_blocks),
    )  # fmt: skip
    runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True))
    return Job([spec], JobConfig(num_devices=1, run_dir=str(work), runtime=runtime))


async def replay_on(
    server: VLLMServer,
    work: Path,
    policy: RequestPolicy,
    it: IterationTrace,
    kv_blocks: int,
) -> Run:
    """Replay ``it`` through a fresh job on ``server`` (its prefix cache reset first) with
    ``policy`` ordering the dispatcher's queue."""
    async with VLLMClient(VLLMClientConfig(base_url=server.url)) as client:
        await client.reset_prefix_cache()
        before = await client.load()
        peak = [0.0]

        async def poll() -> None:
            while True:
                peak[0] = max(peak[0], (await client.load()).kv_cache_usage)
                await asyncio.sleep(0.05)

        job = rollout_job(server, work, policy, kv_blocks)
        async with job, asyncio.TaskGroup() as group:
            poller = group.create_task(poll())
            try:
                report = await replay_trace(job, it, vocab=VOCAB)
            finally:
                poller.cancel()
            dispatcher = job.controller.manager("rollout").dispatcher
            assert dispatcher is not None
            overtakes = dispatcher.router.max_overtakes_seen
            assert dispatcher.shadows is not None
            check = dispatcher.shadows.check
        after = await client.load()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return Run(
        report=report,
        kv_peak=peak[0],
        preemptions=after.num_preemptions - before.num_preemptions,
        engine_hit_rate=hits / queries if queries else 0.0,
        max_overtakes=overtakes,
        shadow_exact=check.exact_share,
        shadow_error=check.abs_error_tokens / max(1, check.predictions),
    )


async def all_runs(
    model: Path, work: Path, kv_blocks: int, it: IterationTrace, reps: int
) -> tuple[Run, Run, dict[str, list[Run]], EngineProfile, RolloutSpec]:
    """The control (ample KV) and the profiling pass (the simulator's model fitted and
    frozen), then on the pressure server every policy ``reps`` times."""
    async with VLLMServer(server_config(model, work / "control", None)) as server:
        ample = AMPLE_BLOCKS
        control = await replay_on(server, work / "control" / "run", FifoPolicy(), it, ample)
        async with rollout_job(server, work / "profile", FifoPolicy(), ample) as job:
            profile = await profile_engine(job, vocab=VOCAB)
    spec = vllm_spec(profile, kv_blocks)
    print(f"simulator model frozen before the policy runs: {spec_digest(spec)}", flush=True)
    runs: dict[str, list[Run]] = {name: [] for name in POLICIES}
    names = list(POLICIES)
    async with VLLMServer(server_config(model, work / "pressure", kv_blocks)) as server:
        for rep in range(reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                where = work / f"{name}-{rep}"
                run = await replay_on(server, where, POLICIES[name], it, kv_blocks)
                runs[name].append(run)
                print(f"round {rep + 1} {name:>8}: {run.report.wall_s:.2f} s", flush=True)
    return runs["fifo"][0], control, runs, profile, spec


def vllm_spec(profile: EngineProfile, kv_blocks: int) -> RolloutSpec:
    """The simulator's model of the pressure server: its configuration, the profile's
    speeds. vLLM keeps one of its KV blocks as the null block; it reserves nothing for
    future tokens (blocks are allocated as decoding goes) and preempts the newest running
    request when a step finds no free block (modelled as a retraction freeing a few steps
    of headroom); its prefix cache serves whole blocks only, siblings share a cached
    prompt's blocks while they run, and a freed sequence's blocks are evicted last first
    (``shared_prefix``)."""
    base = RolloutSpec(
        tp=1, kv_capacity_tokens=(kv_blocks - 1) * BLOCK, max_running_requests=MAX_NUM_SEQS,
        step_fixed_s=1.0, step_per_seq_s=0.0, step_per_kv_token_s=0.0, prefill_tokens_per_s=1.0,
        new_token_ratio=0.0, min_new_token_ratio=0.0, retract_decode_steps=8,
        cache_block_tokens=BLOCK, shared_prefix=True,
    )  # fmt: skip
    return profile.fit(base)


def predictions(
    spec: RolloutSpec, it: IterationTrace, measured: dict[str, float], control_s: float
) -> dict[str, Any]:
    """The frozen model's iteration time of every policy (and of the control) on ``it``,
    with its relative error against the measured medians."""
    root = Path(__file__).resolve().parents[1]
    base = load_workload(root / "examples" / "workloads" / "agentic-7b-64gpu.toml")
    batch = dataclasses.replace(base.batch, max_seq_len=MAX_MODEL_LEN)
    workload = dataclasses.replace(base, rollout=spec, batch=batch)
    out: dict[str, Any] = {}
    for name, policy in POLICIES.items():
        replay = replay_rollout(workload, it, policy)
        out[name] = {
            "iteration_s": round(replay.iteration_s, 3),
            "error": round(replay.iteration_s / measured[name] - 1.0, 4),
            "hit_rate": round(replay.hit_rate, 4),
            "reprefill_tokens": replay.reprefill_tokens,
            "retractions": replay.retractions,
        }
    ample = dataclasses.replace(spec, kv_capacity_tokens=AMPLE_BLOCKS * BLOCK)
    control = replay_rollout(dataclasses.replace(workload, rollout=ample), it, FifoPolicy())
    out["control"] = {
        "iteration_s": round(control.iteration_s, 3),
        "error": round(control.iteration_s / control_s - 1.0, 4),
        "hit_rate": round(control.hit_rate, 4),
    }
    return out


def summary(runs: list[Run]) -> dict[str, Any]:
    """Medians and spread of every figure over a policy's runs."""
    figures = [r.figures() for r in runs]
    out: dict[str, Any] = {}
    for key in figures[0]:
        values = [f[key] for f in figures]
        out[key] = statistics.median(values)
        out[f"{key}_spread"] = [min(values), max(values)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=32, help="episodes (groups of 4)")
    parser.add_argument("--kv-blocks", type=int, default=16, help="pressure run's KV blocks")
    parser.add_argument("--reps", type=int, default=5, help="rounds of every policy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    it = trace(max(1, args.episodes // 4), 4, args.seed)
    with tempfile.TemporaryDirectory(prefix="dynarl-priority-") as tmp:
        work = Path(tmp)
        model = write_tiny_llama(work / "model", seed=0, max_position_embeddings=MAX_MODEL_LEN)
        pressure, control, runs, profile, spec = asyncio.run(
            all_runs(model, work, args.kv_blocks, it, args.reps)
        )
    figures: dict[str, Any] = {"pressure": pressure.figures(), "control": control.figures()}
    figures["pressure_verified"] = (
        pressure.kv_peak >= 0.95
        and pressure.preemptions > 0
        and pressure.report.hit_rate < control.report.hit_rate
    )
    policies = {name: summary(values) for name, values in runs.items()}
    fifo, fifo_aa = runs["fifo"], runs["fifo-aa"]
    noise = statistics.median(
        abs(a.report.wall_s - b.report.wall_s) / ((a.report.wall_s + b.report.wall_s) / 2)
        for a, b in zip(fifo, fifo_aa, strict=True)
    )
    base = policies["fifo"]["iteration_s"]
    gains = {name: base / p["iteration_s"] - 1.0 for name, p in policies.items()}
    for name, p in policies.items():
        claim = "above noise" if abs(gains[name]) > noise else "within noise"
        print(
            f"{name:>8}: iteration {p['iteration_s']:.2f} s {p['iteration_s_spread']}  "
            f"hit {p['hit_rate']:.3f}  re-prefill {p['reprefill_tokens']:.0f}  "
            f"preemptions {p['preemptions']:.0f}  wait p99 {p['wait_p99_s']:.2f} s  "
            f"overtakes {p['max_overtakes_spread'][1]}  shadow exact {p['shadow_exact']:.2f}  "
            f"vs FIFO {gains[name]:+.1%} ({claim})"
        )
    bound_held = all(r.max_overtakes <= MAX_OVERTAKES for v in runs.values() for r in v)
    measured = {name: p["iteration_s"] for name, p in policies.items()}
    predicted = predictions(spec, it, measured, control.report.wall_s)
    sim_gain = predicted["fifo"]["iteration_s"] / predicted["dynarl"]["iteration_s"] - 1.0
    for name, p in predicted.items():
        print(f"sim {name:>8}: {p['iteration_s']:.2f} s (error {p['error']:+.1%})")
    figures.update(
        policies=policies,
        aa_noise=round(noise, 4),
        gains_over_fifo={k: round(v, 4) for k, v in gains.items()},
        priority_gain_over_fifo=round(gains["dynarl"], 4),
        priority_gain_above_noise=abs(gains["dynarl"]) > noise,
        max_overtakes_bound=MAX_OVERTAKES,
        overtakes_within_bound=bound_held,
        sim_gain_error=round(sim_gain - gains["dynarl"], 4),
        sim={
            "model": dataclasses.asdict(spec),
            "model_digest": spec_digest(spec),
            "profile": profile.to_dict(),
            "predicted": predicted,
            "predicted_gain_over_fifo": round(sim_gain, 4),
        },
        kv_blocks=args.kv_blocks,
        reps=args.reps,
        episodes=it.num_samples,
        turns_in_trace=int(it.turn_start[-1]),
    )
    sys.stdout.flush()
    print(json.dumps(figures))
    return 0 if figures["pressure_verified"] and bound_held else 1


if __name__ == "__main__":
    sys.exit(main())
