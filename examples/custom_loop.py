"""A custom RL loop that embeds dynarl and keeps control of its own loop.

Three devices, one worker process each: a rollout engine on two of them, a trainer on the
third (dynarl's testing components: a scripted engine and a small data-parallel trainer;
the reference backend's real model plugs in the same way). Each iteration the loop hands
the engine a batch of prompts — a few of them with long answers, so the rollout ends in a
tail — and trains on every sample as soon as it comes out. While the loop runs, dynarl's
scheduler watches both components; when the tail leaves the engines idle it drains one of
them (its in-flight generation continues on the other engine) and grows the trainer onto
it by a P2P reshard. The loop itself never waits for any of that.

A worker that dies meanwhile (killed, out of memory) is handled the same way, as a device
taken away: an engine's requests continue on the other engine, or on a device the trainer
gives up if it was the last one. The trainer here keeps no checkpoint (``DurableRun`` does
that), so losing its worker stops the job with one error naming the component, worker,
device and signal.

Run: ``.venv/bin/python examples/custom_loop.py`` (about half a minute). The run directory
(the ledger ``events.jsonl``, the workers' logs) is a temporary one removed at the end;
``--run-dir DIR`` keeps it in ``DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile

import dynarl
from dynarl.bus import GenerationRequest, MigrationRecord, Sample, pack_tokens
from dynarl.errors import WorkerLostError
from dynarl.sched import ComponentProfile, ProfilePoint, SchedulerConfig
from dynarl.testing import ScriptedRollout, TinyTrainer


def prompts(iteration: int, count: int) -> list[GenerationRequest]:
    """A batch whose first two answers are long (the tail), the rest short."""
    return [
        GenerationRequest(
            sample_id=f"it{iteration}-q{i}",
            prompt_id=f"it{iteration}-q{i // 4}",
            token_ids=pack_tokens(list(range(100 + i))),
            max_new_tokens=300 if i < 2 else 30,
        )
        for i in range(count)
    ]


def components() -> list[dynarl.ComponentSpec]:
    """What the job is made of, and what the scheduler knows about it beforehand."""
    rollout = ComponentProfile(
        points=(
            ProfilePoint(num_devices=1, throughput=4.0),
            ProfilePoint(num_devices=2, throughput=8.0),
        ),
        items_per_device=8.0,
    )
    trainer = ComponentProfile(
        points=(
            ProfilePoint(num_devices=1, throughput=1.0),
            ProfilePoint(num_devices=2, throughput=2.0),
        )
    )
    return [
        dynarl.ComponentSpec(
            role=ScriptedRollout,
            devices=(0, 1),
            options={"tokens_per_s": 60.0, "kv_capacity": 4096},
            profile=rollout,
        ),
        dynarl.ComponentSpec(
            role=TinyTrainer, devices=(2,), options={"step_s": 0.2}, profile=trainer
        ),
    ]


async def train(job: dynarl.Job, iteration: int, count: int) -> list[Sample]:
    """Generate a batch and train on each sample as it finishes; returns the samples."""
    job.submit("rollout", prompts(iteration, count))
    job.set_remaining("trainer", 4 * count)
    finished = job.output("rollout")
    samples: list[Sample] = []
    while len(samples) < count:
        samples.append(await finished.get(timeout=120))
        stats = await job.call("trainer", "train_step", [samples[-1]])
        print(
            f"  iteration {iteration}: {len(samples):2d}/{count} samples, trained on "
            f"{len(stats)} device(s), allocation {job.allocation.as_dict()}"
        )
    job.new_iteration()
    return samples


async def main(iterations: int, count: int, run_dir: str) -> None:
    scheduler = SchedulerConfig(donor_window_s=1.0, stats_window_s=5.0, decision_interval_s=0.5)
    config = dynarl.JobConfig(
        run_dir=run_dir,
        runtime=dynarl.RuntimeConfig(scheduler=scheduler, report_interval_s=0.5),
    )
    async with dynarl.Job(components(), config) as job:
        print(f"job started: {job.allocation.as_dict()}, run directory {job.run_dir}")
        for iteration in range(iterations):
            await train(job, iteration, count)
        digest = await job.call("trainer", "checksum")
        print(
            f"trainer state {digest[0].values['checksum']} after {digest[0].values['steps']} steps"
        )
        for record in job.ledger.query(kind="migration"):
            assert isinstance(record, MigrationRecord)
            print(
                f"  {record.migration_id}: {record.kind} of {record.component} "
                f"{list(record.src_devices)} -> {list(record.dst_devices)} {record.outcome}, "
                f"pause {record.pause_s * 1000:.1f} ms, {record.bytes_moved} bytes"
            )
        moves = len(job.ledger.query(kind="decision", committed=True))
        print(
            f"final allocation {job.allocation.as_dict()}, {moves} move(s) decided by the scheduler"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument(
        "--run-dir", help="keep the run directory here (default: a temporary one, removed)"
    )
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        run_dir = args.run_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="dynarl-custom-loop-")
        )
        try:
            asyncio.run(main(args.iterations, args.samples, run_dir))
        except WorkerLostError as lost:  # a worker died and the job could not go on
            raise SystemExit(f"job stopped: {lost}") from None
