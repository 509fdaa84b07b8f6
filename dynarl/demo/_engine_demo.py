"""``dynarl demo --engine vllm``: the GRPO job on real vLLM engines and the Megatron trainer.

The reference demo's job — task, episodes, rewards, tool calls, device schedules and GRPO
driver — with the production pieces in place of the reference ones: one vLLM server per
device (:class:`EnginePool`: started once, pinned to the device's core, and reused by every
run — each run's trainer pushes its initial weights to every engine before the first step,
and the prefix caches are reset between runs), attached to by
:class:`~dynarl.backends.serving.EngineRollout`, and the
:class:`~dynarl.backends.megatron.MegatronTrainerRole` loaded from the same Hugging Face
checkpoint (:func:`~dynarl.demo._engine_model.write_task_llama`, warmed up once and cached),
pushing its weights to every engine after each step.

Every schedule — static sequential, every static split, dynarl — runs ``repetitions`` times,
alternating (one of each, then again), and the comparison takes medians. A batching engine
does not give bitwise-equal tokens from run to run, so what the runs must agree on is
checked another way (:class:`EngineComparison`):

* the manifests (sample ids, micro-batches, update order) are identical in every run;
* every trained token carries the weight version its step's rollout was served under;
* *trainer replay*: the samples the first dynarl run trained on, fed in the same order to a
  fresh trainer in the static-sequential layout (every device, data parallel), give bitwise
  the dynarl run's checksum after every step — whatever the scheduler moved, the trainer
  computed what the schedule-free program would have;
* the engines' log-probs of the trained tokens agree with the trainer's teacher-forced ones
  (the largest gap, reported; fp32 on both sides).

Runs on the caller's event loop (servers are watched from the loop that started them).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dynarl.backends.megatron import MegatronSetup, MegatronTrainConfig, MegatronTrainerRole
from dynarl.backends.reference import CharTokenizer, ReferenceSetup
from dynarl.backends.serving import EngineRollout, EngineSetup
from dynarl.backends.vllm import (
    VLLMClient,
    VLLMClientConfig,
    VLLMServer,
    VLLMServerConfig,
)
from dynarl.bus import Sample
from dynarl.demo._device_schedules import RunPlan
from dynarl.demo._driver import EngineWeights
from dynarl.demo._engine_model import SFT_LR, write_task_llama
from dynarl.demo._experiment import (
    ExperimentConfig,
    Observer,
    RunResult,
    plans,
    profiles_from,
    run_plan,
)
from dynarl.errors import BackendError
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import ComponentProfile

__all__ = [
    "EngineComparison",
    "EngineDemoConfig",
    "EnginePool",
    "compare_repetitions",
    "engine_components",
    "prepare_model",
    "replay_checksums",
    "run_repetitions",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineDemoConfig:
    """The vLLM demo: the job (an :class:`ExperimentConfig`, its reference-only fields
    unused: the KL weight, the reference engine's settings) and the engines."""

    experiment: ExperimentConfig
    """Task, model size, steps, prompts, devices, seed and the scheduler's tuning."""
    repetitions: int = 3
    """Runs of each schedule, alternating; the comparison takes medians."""
    python: str = sys.executable
    """The interpreter that runs vLLM (``DYNARL_VLLM_PYTHON`` for the CLI)."""
    max_num_seqs: int = 64
    """Requests each engine runs at once (also the rollout's in-flight limit per device)."""
    kv_cache_gib: int = 1
    """Each engine's KV cache, GiB (vLLM's CPU backend)."""
    startup_timeout_s: float = 600.0
    """Bound on one server's start."""

    def __post_init__(self) -> None:
        if self.repetitions < 1 or self.max_num_seqs < 1 or self.kv_cache_gib < 1:
            raise ValueError(
                "EngineDemoConfig: repetitions, max_num_seqs and kv_cache_gib must be >= 1"
            )

    def runtime(self) -> RuntimeConfig:
        """The experiment's runtime settings with each device pinned to its core (its
        worker, and the engine server of that device beside it)."""
        return replace(self.experiment.runtime(), pin_cores=True)


def prepare_model(config: EngineDemoConfig, cache_dir: str | Path) -> Path:
    """The warmed-up policy's checkpoint directory: from ``cache_dir`` when one of the same
    configuration is there, else written there (this thread, a few tens of seconds)."""
    experiment = config.experiment
    path = Path(cache_dir) / f"llama-{experiment.key()}-lr{SFT_LR:g}"
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + ".tmp")
        write_task_llama(
            experiment.setup(),
            tmp,
            hidden_size=experiment.hidden_size,
            num_layers=experiment.num_layers,
            sft_steps=experiment.sft_steps,
        )
        tmp.replace(path)
    return path


class EnginePool:
    """One vLLM server per device on ``model``, each pinned to its device's core where this
    process may use as many cores as there are devices; started by ``async with`` and
    stopped with it (every process it started). Logs go to ``log_dir``.

    Each engine's token budget per step holds every running sequence's whole context, so no
    prefill is ever split over steps: vLLM 0.32's CPU backend fails a *seeded* request whose
    prefill is split (``RuntimeError: CPU Generator does not use offset`` in
    ``_bookkeeping_sync``, which kills the engine), and the job seeds every request.
    """

    def __init__(self, model: Path, config: EngineDemoConfig, *, log_dir: Path) -> None:
        cores = sorted(os.sched_getaffinity(0))
        devices = config.experiment.num_devices
        pinned = len(cores) >= devices
        max_len = max(512, config.experiment.setup().engine.max_seq_len)
        self.servers = [
            VLLMServer(
                VLLMServerConfig(
                    model=str(model),
                    python=config.python,
                    dtype="float32",
                    enforce_eager=True,
                    max_model_len=max_len,
                    max_num_seqs=config.max_num_seqs,
                    extra_args=(
                        "--max-num-batched-tokens",
                        str(config.max_num_seqs * max_len),
                    ),
                    cpu_kvcache_space_gib=config.kv_cache_gib,
                    cpu_omp_threads_bind="nobind",
                    omp_num_threads=1,
                    cpus=(cores[device],) if pinned else (),
                    env=(("HF_HUB_OFFLINE", "1"),),
                    log_dir=str(log_dir),
                    startup_timeout_s=config.startup_timeout_s,
                )
            )
            for device in range(devices)
        ]

    async def __aenter__(self) -> EnginePool:
        try:
            await asyncio.gather(*(server.start() for server in self.servers))
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every server (idempotent)."""
        await asyncio.gather(*(server.aclose() for server in self.servers))

    @property
    def urls(self) -> dict[str, str]:
        """Device (as text) → its server's URL: the rollout's ``EngineSetup.urls``."""
        return {str(device): server.url for device, server in enumerate(self.servers)}

    def targets(self) -> str:
        """Every device's engine as ``MegatronTrainerRole.push_weights`` takes them."""
        return json.dumps([{"kind": "vllm", "url": server.url} for server in self.servers])

    async def reset_caches(self) -> None:
        """Empty every engine's prefix cache (between runs: no run starts warm)."""

        async def reset(url: str) -> None:
            async with VLLMClient(VLLMClientConfig(base_url=url)) as client:
                if not await client.reset_prefix_cache():
                    raise BackendError(f"vLLM at {url} refused to reset its prefix cache")

        await asyncio.gather(*(reset(server.url) for server in self.servers))


def engine_components(
    setup: ReferenceSetup,
    plan: RunPlan,
    *,
    pool: EnginePool,
    model: Path,
    config: EngineDemoConfig,
    profiles: Mapping[str, ComponentProfile] | None = None,
) -> list[ComponentSpec]:
    """The rollout (the pool's engines) and the Megatron trainer (``model``'s weights, the
    experiment's learning rate), placed for ``plan`` as the reference job places its own."""
    profiles = profiles or {}
    chars = CharTokenizer()
    stops = (chars.eos_id, *(t for ch in setup.make_task().stop_chars for t in chars.encode(ch)))
    rollout = EngineSetup(
        urls=pool.urls,
        max_num_seqs=config.max_num_seqs,
        stop_token_ids=tuple(dict.fromkeys(stops)),
    )
    trainer = MegatronSetup.from_hf(
        model,
        train=MegatronTrainConfig(
            lr=config.experiment.lr, device="cpu", temperature=setup.temperature
        ),
        num_threads=1,
    )
    home = plan.home
    return [
        ComponentSpec(
            role=EngineRollout,
            devices=tuple(d for d in plan.devices if d not in home),
            options=rollout.to_options(),
            profile=profiles.get("rollout"),
            max_inflight=config.max_num_seqs,
            min_devices=1,
        ),
        ComponentSpec(
            role=MegatronTrainerRole,
            devices=home,
            options=trainer.to_options(),
            profile=profiles.get("trainer"),
            min_devices=0,
        ),
    ]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineComparison:
    """Every repetition of every schedule on real engines, and what they agree on."""

    runs: dict[str, tuple[RunResult, ...]]
    """Schedule label → its runs, in repetition order."""
    medians: dict[str, float]
    """Schedule label → median wall time, seconds."""
    speedup_vs_static: float
    """Static sequential's median over dynarl's."""
    speedup_vs_best_split: float
    """The best split's median over dynarl's."""
    best_split: str
    """The split with the lowest median."""
    ratios: dict[str, tuple[float, ...]]
    """Schedule label → that run's wall time over dynarl's, per repetition."""
    manifests_equal: bool
    """Every run's per-step manifests identical."""
    versions_as_expected: bool
    """No trained token of any run carries another version than its step's rollout."""
    stale_tokens: int
    """Trained tokens, over all runs, that do (0 when ``versions_as_expected``)."""
    replay_checksums_equal: bool
    """The replay of the first dynarl run reproduced its checksum after every step."""
    logprob_max_abs_diff: float
    """Largest engine-vs-trainer log-prob gap of any trained token of any run."""

    def to_json(self) -> dict[str, Any]:
        """The figures ``bench/e2e.py --engine vllm`` prints."""
        loads = [r.load.foreign_cores for v in self.runs.values() for r in v if r.load]
        return {
            "speedup_vs_static": round(self.speedup_vs_static, 3),
            "speedup_vs_best_split": round(self.speedup_vs_best_split, 3),
            "best_split": self.best_split,
            "ratios": {k: [round(r, 3) for r in v] for k, v in self.ratios.items()},
            "medians_s": {k: round(v, 2) for k, v in self.medians.items()},
            "walls_s": {k: [round(r.wall_s, 2) for r in v] for k, v in self.runs.items()},
            "manifests_equal": self.manifests_equal,
            "versions_as_expected": self.versions_as_expected,
            "stale_tokens": self.stale_tokens,
            "replay_checksums_equal": self.replay_checksums_equal,
            "logprob_max_abs_diff": self.logprob_max_abs_diff,
            "foreign_cores_max": round(max(loads, default=0.0), 3),
        }


async def run_repetitions(
    config: EngineDemoConfig,
    setup: ReferenceSetup,
    model: Path,
    pool: EnginePool,
    run_dir: Path,
    *,
    note: Callable[[str], None] = lambda _: None,
    observer: Observer | None = None,
) -> EngineComparison:
    """Every schedule ``config.repetitions`` times, alternating, on ``pool``'s engines; then
    the replay of the first dynarl run; the comparison."""
    experiment = config.experiment
    dynarl_plan, sequential_plan, split_plans = plans(experiment)
    order = [sequential_plan, *split_plans, dynarl_plan]
    runs: dict[str, list[RunResult]] = {plan.label: [] for plan in order}
    trained: list[tuple[Sample, ...]] = []
    profiles: dict[str, ComponentProfile] | None = None
    for rep in range(config.repetitions):
        for plan in order:
            note(f"{plan.label} (repetition {rep + 1} of {config.repetitions})")
            await pool.reset_caches()
            where = run_dir / f"{plan.label.replace('/', '-')}-{rep + 1}"
            result = await run_plan(
                setup,
                plan,
                experiment,
                run_dir=where,
                profiles=profiles if plan is dynarl_plan else None,
                observer=observer,
                components=engine_components(
                    setup,
                    plan,
                    pool=pool,
                    model=model,
                    config=config,
                    profiles=profiles if plan is dynarl_plan else None,
                ),
                weights=EngineWeights(pool.targets()),
                runtime=config.runtime(),
            )
            runs[plan.label].append(result)
            if plan is sequential_plan and profiles is None:
                profiles = profiles_from(result, experiment)
            if plan is dynarl_plan and not trained:
                trained = list(result.trained)
    note("trainer replay of the first dynarl run")
    replayed = await replay_checksums(
        trained, model=model, config=config, run_dir=run_dir / "replay"
    )
    first = runs[dynarl_plan.label][0]
    return compare_repetitions(
        {label: tuple(results) for label, results in runs.items()},
        dynarl=dynarl_plan.label,
        sequential=sequential_plan.label,
        replay_equal=replayed == tuple(s.checksum for s in first.steps),
    )


async def replay_checksums(
    trained: Sequence[tuple[Sample, ...]],
    *,
    model: Path,
    config: EngineDemoConfig,
    run_dir: Path,
) -> tuple[str, ...]:
    """Train a fresh Megatron trainer from ``model`` on every device (the static-sequential
    layout, data parallel) on ``trained`` — per step, its samples in update order — and
    return the state's checksum after every step."""
    experiment = config.experiment
    trainer = MegatronSetup.from_hf(
        model,
        train=MegatronTrainConfig(
            lr=experiment.lr, device="cpu", temperature=experiment.setup().temperature
        ),
        num_threads=1,
    )
    devices = tuple(range(experiment.num_devices))
    spec = ComponentSpec(role=MegatronTrainerRole, devices=devices, options=trainer.to_options())
    job_config = JobConfig(num_devices=len(devices), run_dir=str(run_dir), runtime=config.runtime())
    checksums = []
    async with Job([spec], job_config) as job:
        for samples in trained:
            micros = len({s.metadata.get("group") for s in samples})
            await job.call("trainer", "learn", list(samples), num_samples=len(samples))
            results = await job.call("trainer", "step", num_micros=micros, num_samples=len(samples))
            values = {str(r.values.get("checksum")) for r in results}
            if len(values) != 1:
                raise BackendError(f"replay: trainer ranks disagree on the checksum: {values}")
            checksums.append(values.pop())
    return tuple(checksums)


def compare_repetitions(
    runs: Mapping[str, Sequence[RunResult]],
    *,
    dynarl: str,
    sequential: str,
    replay_equal: bool,
) -> EngineComparison:
    """Medians, ratios and the agreement checks of ``runs`` (label → repetitions, the same
    number of each). Raises ValueError without a split, or with unequal repetitions."""
    counts = {len(v) for v in runs.values()}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"every schedule needs the same number of runs, got {counts}")
    splits = [label for label in runs if label not in (dynarl, sequential)]
    if not splits:
        raise ValueError("compare_repetitions needs at least one static split")
    medians = {label: statistics.median(r.wall_s for r in v) for label, v in runs.items()}
    best = min(splits, key=medians.__getitem__)
    ours = runs[dynarl]
    everything = [r for v in runs.values() for r in v]
    stale = sum(s.stale_tokens for r in everything for s in r.steps)
    gaps = [s.logprob_gap for r in everything for s in r.steps if s.logprob_gap is not None]
    return EngineComparison(
        runs={label: tuple(v) for label, v in runs.items()},
        medians=medians,
        speedup_vs_static=medians[sequential] / medians[dynarl],
        speedup_vs_best_split=medians[best] / medians[dynarl],
        best_split=best,
        ratios={
            label: tuple(r.wall_s / d.wall_s for r, d in zip(v, ours, strict=True))
            for label, v in runs.items()
            if label != dynarl
        },
        manifests_equal=len({r.manifest_digest() for r in everything}) == 1,
        versions_as_expected=stale == 0,
        stale_tokens=stale,
        replay_checksums_equal=replay_equal,
        logprob_max_abs_diff=max(gaps) if gaps else float("nan"),
    )
