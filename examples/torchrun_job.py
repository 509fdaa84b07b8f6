"""A job file: a whole dynarl job in one module, launched across nodes by torchrun.

The job is the reference backend's GRPO job: a rollout engine (``ReferenceRollout``) on
device 0 and a trainer (``ReferenceTrainer``) on device 1, driven by the loop in
:func:`grpo`. :func:`job` turns the job's own arguments into a :class:`dynarl.JobSpec`;
the launcher calls it on rank 0 only, so the supervised warm start that makes the initial
weights runs once (cached in ``--cache`` by configuration)::

    # on every node (see examples/torchrun_two_node.sh and docs/torchrun.md)
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m dynarl.runtime.launch --job torchrun_job:job --job-dir /shared/run1 ... \\
        -- --steps 2

    # the same job on this machine (dynarl.Job's local launcher: one process per device)
    python examples/torchrun_job.py --run-dir /tmp/run1 --steps 2

Rank 0 runs the controller and the loop; rank ``r`` is device ``r``'s worker. With
``--grow`` every device trains after each rollout: the trainer grows onto device 0 by a P2P
reshard and shrinks back (roles move between the ranks; the processes stay). When the
loop returns, every rank exits 0. The loop writes ``result.json`` into the run directory
(``--job-dir`` under torchrun): per step, the manifest (sample ids by micro-batch, in
update order), the rewards and the trainer's state checksum — in deterministic mode the
same wherever the job runs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import dynarl
from dynarl.backends.reference import (
    EngineConfig,
    Episodes,
    GPTConfig,
    ReferenceRollout,
    ReferenceSetup,
    ReferenceTrainer,
    save_weights_file,
    warm_start,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """The job's own arguments (after ``--`` on the launcher's command line)."""

    steps: int
    """GRPO steps."""
    prompts: int
    """Prompts per step (one micro-batch of ``group_size`` episodes each)."""
    group_size: int
    """Episodes per prompt."""
    warm_start_steps: int
    """Supervised steps that make the initial weights."""
    cache: Path
    """Where the initial weights are kept, by configuration."""
    run_dir: str | None
    """The run directory of a local run (under torchrun: ``--job-dir``)."""
    grow: bool
    """After each rollout, every device trains: the trainer grows onto the rollout's
    device (a P2P reshard: between the nodes under torchrun) and shrinks back."""


def parse(args: Sequence[str]) -> Options:
    """The job's arguments (argparse: exits on bad ones)."""
    parser = argparse.ArgumentParser(prog="torchrun_job")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--warm-start-steps", type=int, default=30)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir(), "dynarl-init"))
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--grow", action="store_true")
    ns = parser.parse_args(list(args))
    return Options(
        steps=ns.steps,
        prompts=ns.prompts,
        group_size=ns.group_size,
        warm_start_steps=ns.warm_start_steps,
        cache=ns.cache,
        run_dir=ns.run_dir,
        grow=ns.grow,
    )


def prepared(options: Options) -> ReferenceSetup:
    """The deterministic setup and its initial weights (warm-started once per
    configuration, then read from ``options.cache``)."""
    setup = ReferenceSetup(
        model=GPTConfig(),
        engine=EngineConfig(deterministic=True),
        group_size=options.group_size,
    )
    key = hashlib.sha256(f"{setup!r} {options.warm_start_steps}".encode()).hexdigest()[:16]
    path = options.cache / f"init-{key}.pt"
    if not path.exists():
        options.cache.mkdir(parents=True, exist_ok=True)
        weights = warm_start(setup, num_steps=options.warm_start_steps)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_weights_file(tmp, weights)
        tmp.replace(path)  # whole or absent: a concurrent reader never sees half a file
    return replace(setup, init_path=str(path))


async def grpo(setup: ReferenceSetup, options: Options, job: dynarl.Job) -> None:
    """The user's loop: GRPO steps on the running job, then ``result.json``."""
    task = setup.make_task()
    output = job.output("rollout")
    if options.grow:  # the loop moves the devices itself: the scheduler only watches
        job.operator("observe_only", "the loop moves the devices")
    steps = []
    for step in range(options.steps):
        problems = task.problems(step=step, num_problems=options.prompts)
        episodes = Episodes(setup, task, step, problems)
        job.new_iteration()
        job.submit("rollout", episodes.first_requests())
        while episodes.num_done < episodes.num_samples:  # single turn: one sample each
            episodes.absorb(await output.get(timeout=300.0))
            for group in episodes.complete_groups():  # learn each group as it completes
                if not options.grow:
                    micro = episodes.micro_batch(group)
                    await job.call("trainer", "learn", micro, num_samples=episodes.num_samples)
        learned_on = job.allocation.devices("trainer")
        if options.grow:  # every device trains: the trainer grows by a P2P reshard
            await reallocate(job, {"rollout": (), "trainer": (0, 1)})
            learned_on = job.allocation.devices("trainer")
            groups = [s for g in range(episodes.num_groups) for s in episodes.micro_batch(g)]
            await job.call("trainer", "learn", groups, num_samples=episodes.num_samples)
        (stats, *_) = await job.call(
            "trainer", "step", num_micros=episodes.num_groups, num_samples=episodes.num_samples
        )
        if options.grow:  # and shrinks back: the rollout wakes on device 0
            await reallocate(job, {"rollout": (0,), "trainer": (1,)})
        version = int(stats.values["version"])  # type: ignore[arg-type]
        await sync_weights(job, tag=f"s{step}", version=version)
        steps.append(
            {
                "manifest": [
                    [s.sample_id for s in episodes.micro_batch(g)]
                    for g in range(episodes.num_groups)
                ],
                "rewards": episodes.rewards(),
                "checksum": stats.values["checksum"],
                "learned_on": list(learned_on),
                "allocation": job.allocation.as_dict(),
            }
        )
        rewards = episodes.rewards()
        print(
            f"step {step}: reward {sum(rewards) / len(rewards):.3f}  "
            f"loss {stats.values['loss']:+.5f}  trained on devices {list(learned_on)}"
        )
    result = {"steps": steps, "num_devices": job.num_devices}
    (job.run_dir / "result.json").write_text(json.dumps(result) + "\n")
    print(f"result: {job.run_dir / 'result.json'}")


async def reallocate(job: dynarl.Job, target: dict[str, tuple[int, ...]]) -> None:
    """Move the devices to ``target`` (a migration of every component that changes)."""
    outcome = await job.reallocate(target)
    if not outcome.ok:
        raise RuntimeError(f"the move to {target} failed: {outcome.reason}")


async def sync_weights(job: dynarl.Job, *, tag: str, version: int) -> None:
    """The trainer's new weights to every rollout engine (a transfer between devices:
    between nodes under torchrun)."""
    rollout = ",".join(map(str, job.allocation.devices("rollout")))
    trainer = ",".join(map(str, job.allocation.devices("trainer")))
    await asyncio.gather(
        job.call("trainer", "sync_weights", rollout=rollout, tag=tag),
        job.call(
            "rollout", "receive_weights", trainer=trainer, rollout=rollout, tag=tag, version=version
        ),
    )


def job(args: Sequence[str]) -> dynarl.JobSpec:
    """The job, from its arguments (what ``--job torchrun_job:job`` names)."""
    options = parse(args)
    setup = prepared(options)
    components = [
        dynarl.ComponentSpec(role=ReferenceRollout, devices=(0,), options=setup.to_options()),
        dynarl.ComponentSpec(role=ReferenceTrainer, devices=(1,), options=setup.to_options()),
    ]
    return dynarl.JobSpec(
        components=components,
        config=dynarl.JobConfig(num_devices=2, run_dir=options.run_dir),
        driver=functools.partial(grpo, setup, options),
    )


if __name__ == "__main__":
    asyncio.run(job(sys.argv[1:]).run())
