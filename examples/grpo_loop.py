"""A GRPO loop on dynarl's runtime, written against the public API only.

Run: ``.venv/bin/python examples/grpo_loop.py [num_steps]``. Two worker processes (one per
device): a rollout component (``ReferenceRollout``: a continuous-batching engine per
device) and a trainer (``ReferenceTrainer``: data parallel, P2P-reshardable). The loop is
the user's: it submits the episodes of a step, scores them as they come back, hands each
complete prompt group to the trainer as one micro-batch, takes the optimizer step, and
syncs the weights to the engines. dynarl's scheduler runs beside it and may move a device
from the rollout to the trainer while the rollout tails; the loop does not change.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from dataclasses import replace

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

NUM_PROMPTS = 4


async def grpo(setup: ReferenceSetup, num_steps: int) -> None:
    components = [
        dynarl.ComponentSpec(role=ReferenceRollout, devices=(0,), options=setup.to_options()),
        dynarl.ComponentSpec(role=ReferenceTrainer, devices=(1,), options=setup.to_options()),
    ]
    task = setup.make_task()
    async with dynarl.Job(components, dynarl.JobConfig(num_devices=2)) as job:
        output = job.output("rollout")
        for step in range(num_steps):
            problems = task.problems(step=step, num_problems=NUM_PROMPTS)
            episodes = Episodes(setup, task, step, problems)
            job.new_iteration()
            job.submit("rollout", episodes.first_requests())
            while episodes.num_done < episodes.num_samples:  # single turn: one sample each
                episodes.absorb(await output.get(timeout=120.0))
                for group in episodes.complete_groups():  # learn each group as it completes
                    micro = episodes.micro_batch(group)
                    await job.call("trainer", "learn", micro, num_samples=episodes.num_samples)
            (stats, *_) = await job.call(
                "trainer", "step", num_micros=episodes.num_groups, num_samples=episodes.num_samples
            )
            await asyncio.gather(
                job.call("trainer", "sync_weights", rollout="0", tag=f"s{step}"),
                job.call(
                    "rollout",
                    "receive_weights",
                    trainer="1",
                    rollout="0",
                    tag=f"s{step}",
                    version=int(stats.values["version"]),  # type: ignore[arg-type]
                ),
            )
            rewards = episodes.rewards()
            print(
                f"step {step}: reward {sum(rewards) / len(rewards):.3f}  "
                f"loss {stats.values['loss']:+.5f}  allocation {job.allocation.as_dict()}"
            )
        print(f"ledger: {len(job.ledger)} records in {job.run_dir / 'events.jsonl'}")


def main() -> None:
    num_steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    setup = ReferenceSetup(model=GPTConfig(), engine=EngineConfig(deterministic=True), group_size=4)
    with tempfile.TemporaryDirectory() as tmp:
        init = save_weights_file(f"{tmp}/init.pt", warm_start(setup, num_steps=30))
        asyncio.run(grpo(replace(setup, init_path=str(init)), num_steps))


if __name__ == "__main__":
    main()
