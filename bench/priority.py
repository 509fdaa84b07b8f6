"""Request priority on a real engine: verified cache pressure, then four policies against their
own noise (issue 20).

A seeded multi-turn agentic trace (``dynarl.sim.agentic_trace``: turns, output lengths with
EOS ignored, tool latencies, observations; prompts and observations spanning several of
vLLM's 128-token CPU blocks) is replayed through a ``dynarl.Job`` on one real server —
``--engine vllm`` (the default) or ``--engine sglang`` (SGLang 0.5.23 from ``make
sglang-env``; ``bench/_priority_engines.py`` holds what differs) — by
``dynarl.demo._agent_replay``: the runtime's dispatcher holds the queue (FIFO here) and
admits up to ``max_num_seqs`` requests. The trace runs twice on the same tiny random Llama:

- **pressure**: a small KV cache, ``--kv`` in the engine's unit (vLLM: 16 blocks,
  ``--num-gpu-blocks-override``; SGLang: 2,048 tokens, ``--max-total-tokens``);
- **control**: the same trace with ample KV (vLLM: 1 GiB, ~500k tokens; SGLang: 500k).

The pressure run is accepted only if its KV use reached 95% (polled every 50 ms), the
engine preempted, retracted or evicted (vLLM: ``vllm:num_preemptions_total`` grew; SGLang:
``sglang:num_retracted_requests_total`` or ``sglang:evicted_tokens_total``) and its prefix
hit rate is below the control's.

Then, on the pressure server, the policies — FIFO (twice: an A/A pair whose difference is
the noise floor), DynaRL's key (``PriorityPolicy``: tool calls done, then cached prefix),
PLAS (``LeastAttainedServicePolicy`` over the episode's attained service) and C-MLFQ
(``ToolMlfqPolicy``) — ``--reps`` rounds each, the order rotated every round, the prefix
cache reset before every run, the scheduler observing only (a fixed allocation). Per
policy: medians and spread (min–max) of the iteration time, hit rate, re-prefilled tokens,
preemptions, waits (p50/p99/max) and the most overtakes a request suffered (asserted
``<= max_overtakes``). A gain over FIFO is paired by round (the median over rounds of FIFO's
time over the policy's, less one: a host that slows between rounds cancels out) and claimed
only above the A/A spread (``aa_noise``: the largest relative difference of the FIFO pair
over the rounds; ``aa_noise_median`` beside it).

The DynaRL key's cached-prefix term comes from the dispatcher's shadow of the engine's
cache (``ComponentSpec.prefix_cache``: vLLM's 128-token blocks, SGLang's tokens), checked
against every request's reported ``cached_tokens`` (``shadow_exact``, ``shadow_error``:
the share predicted exactly, the mean error in tokens). On vLLM the shadow is given the
blocks vLLM can fill: ``--kv`` less the null block vLLM keeps back.

**The simulator against the engine.** On the control server, before any policy run, a
profiling pass (``bench/_vllm_profile.py``: decode step time by batch and KV, prefill
speed, measured through a job as the policies drive the engine) calibrates the simulator's
engine model — the engine's configuration as a ``RolloutSpec`` (``Engine.spec``: for vLLM
the pressure run's KV less its null block, no reserve for future tokens, whole 128-token
blocks reused, a prompt cached as it is scheduled; for SGLang its KV in tokens, its
decaying reserve and retraction, token-granular reuse, a prompt cached when its prefill
batch ends) — which is frozen and named by its hash
(``sim.model_digest``) before the policies run. ``dynarl.sim.replay_rollout`` then predicts
every policy's iteration time on the same trace (and the control's); the errors are
reported per policy (``error``: against the measured median; ``gain_error``: the predicted
gain over FIFO less the paired measured one, which the host's speed does not move), and
``sim_gain_error`` is DynaRL's key's ``gain_error``.

**With the scheduler on** (``--scheduler-reps``, default 5; not with ``--url``): a second
set on a two-device job — two pressure servers, each pinned to its core, shared by the
rollout and a scorer that scores each episode as it ends — where the scheduler lends the
idle scorer's device to the rollout and takes it back when scores queue up
(``bench/_priority_moving.py``): a fixed-allocation run, a ``declared`` run (FIFO, the
scorer's input declared: the scheduler keeps its device) and every policy, rotated, with
its own A/A noise; ``scheduler_on`` in the JSON. The first set's figures are printed
(``fixed allocation: {...}``) before the second set starts, and a failure there is the
JSON's ``scheduler_on.error`` (exit status 1).

Last line, JSON: ``pressure``/``control`` figures, ``pressure_verified``, per policy
``iteration_s``, ``hit_rate``, ``reprefill_tokens``, ``max_overtakes`` (and the rest), and
``aa_noise``, ``priority_gain_over_fifo``, ``sim_gain_error``, and ``sim`` (the model, its
digest, the profile, the predictions and their errors).

    .venv/bin/python bench/priority.py [--engine vllm|sglang] [--episodes N] [--kv N]
        [--reps N] [--scheduler-reps N] [--seed N]

``--url`` runs everything (control, profile, policies) on one running server instead of
starting two, its KV read from it; with
``--max-num-seqs``/``--max-model-len`` set to that server's and ``--quick-profile`` (the
fewest profiling points), it is the smoke in ``make test`` (one episode on the shared vLLM test
server, tests/engines/test_agent_replay.py; on the shared SGLang one in ``make
test-sglang``). Such a run verifies no cache pressure unless
the server's KV is small, and its exit status asks none.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import traceback
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _priority_engines import CONTEXT_MARGIN, ENGINES, Engine
from _priority_moving import (
    aa_differences,
    aa_noise,
    moving_runs,
    moving_summary,
    paired_gain,
    round_walls,
    wait_figures,
)
from _vllm_profile import FULL, QUICK, Grid, profile_engine

from dynarl.backends.serving import EngineRollout
from dynarl.demo._agent_replay import ReplayReport, replay_trace
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import (
    FifoPolicy,
    LeastAttainedServicePolicy,
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
POLICIES: dict[str, RequestPolicy] = {
    "fifo": FifoPolicy(),
    "fifo-aa": FifoPolicy(),
    "dynarl": PriorityPolicy(),
    "plas": LeastAttainedServicePolicy(),
    "cmlfq": ToolMlfqPolicy(quantum=64.0, levels=4),
}
"""The runs of one round; ``fifo-aa`` is FIFO again (the A/A pair)."""


def trace(
    num_prompts: int, group_size: int, seed: int, max_seq_len: int = MAX_MODEL_LEN
) -> IterationTrace:
    """The bench's trace: 300-token prompts shared by a group, 3 tool calls on average,
    150-token observations, turns of ~64 tokens shrinking by 0.8 per turn."""
    return agentic_trace(
        tool_success_rate=0.7,
        seed=seed,
        batch=BatchSpec(
            num_prompts=num_prompts, group_size=group_size, num_minibatches=1,
            max_seq_len=max_seq_len,
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
    evicted_tokens: int
    engine_hit_rate: float
    max_overtakes: int
    shadow_exact: float
    shadow_error: float

    def figures(self) -> dict[str, Any]:
        return {
            "iteration_s": round(self.report.wall_s, 3),
            "hit_rate": round(self.report.hit_rate, 4),
            "engine_hit_rate": round(self.engine_hit_rate, 4),
            "reprefill_tokens": self.report.reprefill_tokens,
            "kv_peak": round(self.kv_peak, 4),
            "preemptions": self.preemptions,
            "evicted_tokens": self.evicted_tokens,
            "max_overtakes": self.max_overtakes,
            "shadow_exact": round(self.shadow_exact, 4),
            "shadow_error": round(self.shadow_error, 2),
            "turns": len(self.report.turns),
            **wait_figures(self.report),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """The engines the runs assume."""

    engine: Engine
    kv: int
    """The pressure server's KV, in the engine's unit (vLLM: blocks, its null block
    included; SGLang: tokens)."""
    control_kv: int
    """The control server's, as its shadow sees it."""
    max_num_seqs: int = MAX_NUM_SEQS
    """Requests an engine runs at once; the dispatcher admits as many."""
    max_model_len: int = MAX_MODEL_LEN
    url: str | None = None
    """A running server for every run (None: the bench starts a control and a pressure
    server)."""
    grid: Grid = FULL
    """The profiling pass's points."""


def rollout_job(url: str, work: Path, policy: RequestPolicy, kv: int, setup: Setup) -> Job:
    """A job whose rollout is the server at ``url`` behind the runtime's dispatcher: the
    queue held and ordered by ``policy``, ``setup.max_num_seqs`` admitted, a shadow of the
    engine's cache of ``kv``, the scheduler observing only."""
    engine, seqs = setup.engine, setup.max_num_seqs
    spec = ComponentSpec(
        role=EngineRollout, devices=(0,), options=engine.setup(url, seqs).to_options(),
        max_inflight=seqs, request_policy=policy, max_overtakes=MAX_OVERTAKES,
        prefix_cache=engine.prefix_cache(kv),
    )  # fmt: skip
    runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True))
    return Job([spec], JobConfig(num_devices=1, run_dir=str(work), runtime=runtime))


async def replay_on(
    url: str, work: Path, policy: RequestPolicy, it: IterationTrace, setup: Setup
) -> Run:
    """Replay ``it`` through a fresh job on the pressure server at ``url`` with ``policy``
    ordering the dispatcher's queue (:func:`replay_in`)."""
    async with rollout_job(url, work, policy, setup.kv, setup) as job:
        return await replay_in(job, setup.engine, url, it)


async def replay_in(job: Job, engine: Engine, url: str, it: IterationTrace) -> Run:
    """Replay ``it`` through ``job`` on the server at ``url``, its prefix cache reset
    first; the shadow's figures are those of ``job`` so far (a fresh job: this replay)."""
    await engine.reset_cache(url)
    before = await engine.counters(url)
    peak = [0.0]

    async def poll() -> None:
        async with engine.kv_meter(url) as usage:
            while True:
                peak[0] = max(peak[0], await usage())
                await asyncio.sleep(0.05)

    async with asyncio.TaskGroup() as group:
        poller = group.create_task(poll())
        try:
            report = await replay_trace(job, it, vocab=VOCAB)
        finally:
            poller.cancel()
    dispatcher = job.controller.manager("rollout").dispatcher
    assert dispatcher is not None and dispatcher.shadows is not None
    check = dispatcher.shadows.check
    after = await engine.counters(url)
    queries = after.prefix_queries - before.prefix_queries
    hits = after.prefix_hits - before.prefix_hits
    return Run(
        report=report,
        kv_peak=peak[0],
        preemptions=after.preemptions - before.preemptions,
        evicted_tokens=after.evicted_tokens - before.evicted_tokens,
        engine_hit_rate=hits / queries if queries else 0.0,
        max_overtakes=dispatcher.router.max_overtakes_seen,
        shadow_exact=check.exact_share,
        shadow_error=check.abs_error_tokens / max(1, check.predictions),
    )


@contextlib.asynccontextmanager
async def serving(setup: Setup, model: Path, work: Path, kv: int | None) -> AsyncIterator[str]:
    """The URL of a server: ``setup.url`` as it is, or one started on ``model`` with ``kv``
    of KV (None: ample)."""
    if setup.url is not None:
        yield setup.url
        return
    async with setup.engine.serve(model, work, kv, setup.max_num_seqs, setup.max_model_len) as url:
        yield url


async def all_runs(
    setup: Setup, model: Path, work: Path, it: IterationTrace, reps: int
) -> tuple[Run, Run, dict[str, list[Run]], EngineProfile, RolloutSpec]:
    """The control (ample KV) and the profiling pass in the same job (the simulator's model
    fitted and frozen), then on the pressure server every policy ``reps`` times."""
    engine = setup.engine
    async with (
        serving(setup, model, work / "control", None) as url,
        rollout_job(url, work / "control" / "run", FifoPolicy(), setup.control_kv, setup) as job,
    ):
        control = await replay_in(job, engine, url, it)
        profile = await profile_engine(job, vocab=VOCAB, grid=setup.grid)
    spec = engine.spec(profile, setup.kv, setup.max_num_seqs)
    print(f"simulator model frozen before the policy runs: {spec_digest(spec)}", flush=True)
    runs: dict[str, list[Run]] = {name: [] for name in POLICIES}
    names = list(POLICIES)
    async with serving(setup, model, work / "pressure", setup.kv) as url:
        for rep in range(reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                run = await replay_on(url, work / f"{name}-{rep}", POLICIES[name], it, setup)
                runs[name].append(run)
                print(f"round {rep + 1} {name:>8}: {run.report.wall_s:.2f} s", flush=True)
    return runs["fifo"][0], control, runs, profile, spec


def predictions(
    spec: RolloutSpec,
    it: IterationTrace,
    measured: dict[str, float],
    control_s: float,
    setup: Setup,
) -> dict[str, Any]:
    """The frozen model's iteration time of every policy (and of the control) on ``it``,
    with its relative error against the measured medians."""
    root = Path(__file__).resolve().parents[1]
    base = load_workload(root / "examples" / "workloads" / "agentic-7b-64gpu.toml")
    batch = dataclasses.replace(base.batch, max_seq_len=setup.max_model_len)
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
    cache = setup.engine.prefix_cache(setup.control_kv)
    ample = dataclasses.replace(spec, kv_capacity_tokens=cache.capacity_blocks * cache.block_size)
    control = replay_rollout(dataclasses.replace(workload, rollout=ample), it, FifoPolicy())
    out["control"] = {
        "iteration_s": round(control.iteration_s, 3),
        "error": round(control.iteration_s / control_s - 1.0, 4),
        "hit_rate": round(control.hit_rate, 4),
    }
    return out


def summary(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and spread of every figure over a policy's runs."""
    out: dict[str, Any] = {}
    for key in figures[0]:
        values = [f[key] for f in figures]
        out[key] = statistics.median(values)
        out[f"{key}_spread"] = [min(values), max(values)]
    return out


def whole(text: str, least: int) -> int:
    """An argument that must be a whole number of at least ``least``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected at least {least}, got {value}")
    return value


def positive(text: str) -> int:
    """An argument that must be a whole number of at least 1."""
    return whole(text, 1)


def count(text: str) -> int:
    """An argument that must be a whole number of at least 0."""
    return whole(text, 0)


def first_set(
    pressure: Run,
    control: Run,
    runs: dict[str, list[Run]],
    profile: EngineProfile,
    spec: RolloutSpec,
    setup: Setup,
    it: IterationTrace,
) -> tuple[dict[str, Any], bool]:
    """The fixed-allocation set's figures (printed as it goes) and whether every run kept
    the overtake bound."""
    figures: dict[str, Any] = {"pressure": pressure.figures(), "control": control.figures()}
    figures["pressure_verified"] = (
        pressure.kv_peak >= 0.95
        and (pressure.preemptions > 0 or pressure.evicted_tokens > 0)
        and pressure.report.hit_rate < control.report.hit_rate
    )
    policies = {name: summary([r.figures() for r in values]) for name, values in runs.items()}
    walls = round_walls(runs)
    noise = aa_noise(walls)
    gains = {name: paired_gain(walls, "fifo", name) for name in runs}
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
    predicted = predictions(spec, it, measured, control.report.wall_s, setup)
    sim_gain = predicted["fifo"]["iteration_s"] / predicted["dynarl"]["iteration_s"] - 1.0
    for name in POLICIES:
        # The gain the model predicts over FIFO against the paired measured gain: free of
        # the host's speed, which moves the absolute errors.
        p = predicted[name]
        p["gain_error"] = round(
            predicted["fifo"]["iteration_s"] / p["iteration_s"] - 1.0 - gains[name], 4
        )
    for name, p in predicted.items():
        gain = f", gain error {p['gain_error']:+.1%}" if "gain_error" in p else ""
        print(f"sim {name:>8}: {p['iteration_s']:.2f} s (error {p['error']:+.1%}{gain})")
    figures.update(
        policies=policies,
        aa_noise=round(noise, 4),
        aa_noise_median=round(statistics.median(aa_differences(walls)), 4),
        gains_over_fifo={k: round(v, 4) for k, v in gains.items()},
        priority_gain_over_fifo=round(gains["dynarl"], 4),
        priority_gain_above_noise=abs(gains["dynarl"]) > noise,
        max_overtakes_bound=MAX_OVERTAKES,
        overtakes_within_bound=bound_held,
        sim_gain_error=predicted["dynarl"]["gain_error"],
        sim={
            "model": dataclasses.asdict(spec),
            "model_digest": spec_digest(spec),
            "profile": profile.to_dict(),
            "predicted": predicted,
            "predicted_gain_over_fifo": round(sim_gain, 4),
        },
        engine=setup.engine.kind,
        kv=setup.kv,
        kv_unit=setup.engine.unit,
        url=setup.url,
        episodes=it.num_samples,
        turns_in_trace=int(it.turn_start[-1]),
    )
    return figures, bound_held


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=positive, default=32, help="episodes (groups of 4)")
    parser.add_argument("--engine", choices=sorted(ENGINES), default="vllm")
    parser.add_argument(
        "--kv", "--kv-blocks", type=positive, dest="kv",
        help="pressure run's KV: blocks (vLLM, default 16) or tokens (SGLang, default 2048)",
    )  # fmt: skip
    parser.add_argument("--reps", type=positive, default=5, help="rounds of every policy")
    parser.add_argument(
        "--scheduler-reps", type=count, default=5,
        help="rounds of the set with the scheduler on (two servers; 0: none, as with --url)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="a running server for every run (its KV as it is)")
    parser.add_argument("--max-num-seqs", type=positive, default=MAX_NUM_SEQS)
    parser.add_argument("--max-model-len", type=positive, default=MAX_MODEL_LEN)
    parser.add_argument("--quick-profile", action="store_true", help="the fewest points")
    args = parser.parse_args(argv)
    engine: Engine = ENGINES[args.engine]()
    group = min(4, args.episodes)
    it = trace(max(1, args.episodes // group), group, args.seed, args.max_model_len)
    with tempfile.TemporaryDirectory(prefix="dynarl-priority-") as tmp:
        work = Path(tmp)
        if args.url is None:
            kv = args.kv or engine.default_kv
            setup = Setup(engine=engine, kv=kv, control_kv=engine.ample_kv)
            model = write_tiny_llama(
                work / "model", seed=0,
                max_position_embeddings=args.max_model_len + CONTEXT_MARGIN,
            )  # fmt: skip
        else:
            kv = engine.server_kv(args.url)
            setup = Setup(engine=engine, kv=kv, control_kv=kv, url=args.url)
            model = work / "unused"
        setup = dataclasses.replace(
            setup, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            grid=QUICK if args.quick_profile else FULL,
        )  # fmt: skip
        pressure, control, runs, profile, spec = asyncio.run(
            all_runs(setup, model, work, it, args.reps)
        )
        figures, bound_held = first_set(pressure, control, runs, profile, spec, setup, it)
        figures.update(reps=args.reps)
        # The first set's figures are printed before the second set starts: a failure
        # there loses nothing of them.
        print(f"fixed allocation: {json.dumps(figures)}", flush=True)
        if args.url is None and args.scheduler_reps:
            try:
                moving = asyncio.run(
                    moving_runs(
                        ENGINES[args.engine], model, work / "scheduler-on", it,
                        policies=POLICIES, reps=args.scheduler_reps, kv=setup.kv,
                        seqs=setup.max_num_seqs, max_len=setup.max_model_len, vocab=VOCAB,
                        max_overtakes=MAX_OVERTAKES,
                    )
                )  # fmt: skip
            except Exception as exc:  # reported in the JSON; the exit status is 1
                traceback.print_exc()
                figures["scheduler_on"] = {"error": f"{type(exc).__name__}: {exc}"}
                bound_held = False
            else:
                figures["scheduler_on"] = moving_summary(*moving, summary, MAX_OVERTAKES)
                bound_held = bound_held and figures["scheduler_on"]["overtakes_within_bound"]
    sys.stdout.flush()
    print(json.dumps(figures))
    pressure_asked = setup.url is None
    return 0 if (figures["pressure_verified"] or not pressure_asked) and bound_held else 1


if __name__ == "__main__":
    sys.exit(main())
