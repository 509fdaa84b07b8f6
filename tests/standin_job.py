"""A hand-written job for the tests of the launcher alone: the launcher's own interface (a
``LaunchedJob``: a controller coroutine on rank 0, a worker coroutine on every rank) with
its rendezvous, CURVE and torchrun's restarts, without the runtime's controller and workers
(``tests/dist/test_torchrun_job.py`` launches a real ``dynarl.Job`` from a job file).

The controller journals an allocation, issues samples from a seekable source, has the
workers "generate" them over the bus (a pure function of each sample's seed), "trains" a
four-number model with torch's RNG, journals every step with its manifest digest and
checkpoints every ``--checkpoint-every`` steps. Restarted, it recovers the journal,
restores the last checkpoint (tensors, RNG, sample cursor) and redoes the steps after it,
which must reproduce their journaled digests. With ``--kill-at STEP`` it SIGKILLs its own
process after that step, once per job directory; with ``--kill-rank R`` (R > 0) the
worker of rank R SIGKILLs itself instead, on the first request of step STEP + 1. At the
end it writes ``result.json`` and stops the workers. :func:`reference` computes the same
run in one process, no bus.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dynarl.bus import (
    BusClient,
    BusConfig,
    BusServer,
    GenerationRequest,
    Interrupt,
    Peer,
    Sample,
    pack_tokens,
    unpack_tokens,
)
from dynarl.errors import WorkerError
from dynarl.runtime import CheckpointStore, Journal
from dynarl.runtime.durable._checkpoint import CheckpointRef
from dynarl.runtime.durable._manifest import Manifest, step_digests
from dynarl.runtime.durable._rng import capture_rng, restore_rng
from dynarl.runtime.durable._source import SampleSource, SourceConfig, Ticket
from dynarl.runtime.launch._torchrun import ControllerContext, WorkerContext
from dynarl.types import Allocation

# Generous: freshly started ranks import torch on a loaded 2-core machine.
CONFIG = BusConfig(heartbeat_interval_s=1.0, num_missed_heartbeats=10, register_timeout_s=30.0)
MAX_TOKENS = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    steps: int
    batch: int
    checkpoint_every: int
    kill_at: int
    kill_rank: int
    seed: int


def parse(args: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    ns = parser.parse_args(list(args))
    return Options(
        steps=ns.steps, batch=ns.batch, checkpoint_every=ns.checkpoint_every,
        kill_at=ns.kill_at, kill_rank=ns.kill_rank, seed=ns.seed,
    )  # fmt: skip


def source_config(options: Options) -> SourceConfig:
    return SourceConfig(seed=options.seed, num_items=5, group_size=2)


def respond(request: GenerationRequest) -> Sample:
    """The workers' "generation": tokens and reward from the sample's seed alone."""
    assert request.seed is not None
    tokens = [(request.seed >> (8 * k)) % 50 for k in range(request.max_new_tokens)]
    prompt = list(unpack_tokens(request.token_ids))
    return Sample(
        sample_id=request.sample_id, token_ids=pack_tokens(prompt + tokens),
        prompt_len=len(prompt), reward=sum(tokens) / 200.0, prompt_id=request.prompt_id,
    )  # fmt: skip


def request_of(ticket: Ticket, step: int = 0) -> GenerationRequest:
    return GenerationRequest(
        sample_id=ticket.sample_id, token_ids=pack_tokens([ticket.item, ticket.member]),
        max_new_tokens=MAX_TOKENS, prompt_id=ticket.prompt_id, seed=ticket.seed,
        metadata={"step": step},
    )  # fmt: skip


def train(weights: torch.Tensor, rewards: Sequence[float]) -> torch.Tensor:
    for reward in rewards:  # update order matters, and so does torch's RNG
        weights = weights + 0.1 * reward * torch.randn(4)
    return weights


def checksum(weights: torch.Tensor) -> str:
    return hashlib.sha256(weights.numpy().tobytes()).hexdigest()


def reference(options: Options) -> dict[str, Any]:
    """The uninterrupted run, in one process."""
    torch.manual_seed(options.seed)
    weights = torch.zeros(4)
    source = SampleSource(source_config(options))
    digests = []
    for step in range(options.steps):
        tickets = source.take(options.batch)
        weights = train(weights, [respond(request_of(t)).reward or 0.0 for t in tickets])
        digests.append(step_digests(step, [t.sample_id for t in tickets])[0])
    return {"checksum": checksum(weights), "digests": digests}


class StandInJob:
    """The ``LaunchedJob`` the launcher's tests launch."""

    async def controller(self, context: ControllerContext) -> None:
        options = parse(context.config.args)
        job_dir = context.config.job_dir
        store = CheckpointStore(job_dir / "checkpoints", num_keep=2)
        manifest = Manifest()
        torch.manual_seed(options.seed)
        weights, resumed_from = torch.zeros(4), -1
        with Journal(job_dir / "journal", job="standin") as journal:
            state = journal.state
            if state.allocation is None:
                journal.commit(Allocation.of({"workers": range(context.env.world_size)}))
            steps_done, cursor, path = 0, 0, ""
            if state.checkpoint is not None:
                ref = CheckpointRef.from_record(state.checkpoint)
                weights = store.read_shard(ref, 0)["weights"].clone()
                rng = store.manifest(ref).shard(0).rng
                assert rng is not None
                restore_rng(rng)
                steps_done, cursor, path = ref.steps_done, ref.cursor, ref.path
                resumed_from = steps_done
            if state.steps_done:
                journal.restored(steps_done=steps_done, cursor=cursor, path=path)
            for step, digest in state.digests:
                manifest.expect(step, digest)
            source = SampleSource(source_config(options), cursor=cursor)
            joined = asyncio.Event()
            bus = BusServer(
                context.bind_address, curve=context.curve, config=CONFIG,
                on_peer=lambda event: joined.set(),
            )  # fmt: skip
            async with bus:
                context.announce(bus.address)
                workers = await _wait_for_workers(bus, joined, context.env.world_size)
                for step in range(steps_done, options.steps):
                    weights = await _step(bus, workers, source, manifest, weights, step, options)
                    closed = manifest.close_step(step)
                    journal.complete_step(step, cursor=source.cursor, digest=closed.digest)
                    if (step + 1) % options.checkpoint_every == 0:
                        ref = store.save(
                            steps_done=step + 1, version=step + 1, cursor=source.cursor,
                            shards={0: {"weights": weights}}, rng={0: capture_rng()},
                        )  # fmt: skip
                        journal.record_checkpoint(
                            steps_done=step + 1, path=ref.path, version=ref.version,
                            cursor=ref.cursor, digest=ref.digest,
                        )  # fmt: skip
                    killed = (job_dir / "killed").exists()
                    if step == options.kill_at and options.kill_rank == 0 and not killed:
                        (job_dir / "killed").touch()
                        os.kill(os.getpid(), signal.SIGKILL)
                report = manifest.report()
                result = {
                    "checksum": checksum(weights),
                    "digests": [d for _, d in report.digests],
                    "violations": [v.kind for v in report.violations],
                    "resumed_from": resumed_from,
                    "restart_count": context.env.restart_count,
                    "workers": workers,
                }
                (job_dir / "result.json").write_text(json.dumps(result))
                for name in workers:
                    await bus.request(name, Interrupt(component="standin", reason="stop"))

    async def worker(self, context: WorkerContext) -> None:
        done = asyncio.Event()
        stopped: list[Interrupt] = []

        def stop(message: Interrupt, peer: Peer) -> None:
            stopped.append(message)
            done.set()

        client = BusClient(
            context.address, name=context.name, config=CONFIG, curve=context.curve,
            on_lost=done.set,
        )  # fmt: skip
        options = parse(context.config.args)
        marker = context.config.job_dir / "killed"

        def serve(message: GenerationRequest, peer: Peer) -> Sample:
            victim = options.kill_rank == context.env.rank > 0
            if victim and message.metadata.get("step") == options.kill_at + 1:
                if not marker.exists():  # a dead rank: torchrun's restart policy takes over
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
            return respond(message)

        client.route(GenerationRequest, serve)
        client.route(Interrupt, stop)
        async with client:
            await done.wait()
        if not stopped:
            raise WorkerError(f"{context.name}: lost the controller")


async def _wait_for_workers(bus: BusServer, joined: asyncio.Event, count: int) -> list[str]:
    async with asyncio.timeout(120):
        while len(bus.peers()) < count:
            await joined.wait()
            joined.clear()
    return sorted(bus.peers())


async def _step(
    bus: BusServer,
    workers: list[str],
    source: SampleSource,
    manifest: Manifest,
    weights: torch.Tensor,
    step: int,
    options: Options,
) -> torch.Tensor:
    tickets = source.take(options.batch)
    for ticket in tickets:
        manifest.issue(ticket.sample_id, step, max_tokens=MAX_TOKENS)

    async def generate(index: int, ticket: Ticket) -> Sample:
        attempt = manifest.dispatch(ticket.sample_id)
        worker = workers[index % len(workers)]
        sample: Sample = await bus.request(worker, request_of(ticket, step), timeout=30)
        manifest.generated(ticket.sample_id, attempt, num_tokens=MAX_TOKENS)
        manifest.scored(ticket.sample_id)
        return sample

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(generate(i, t)) for i, t in enumerate(tickets)]
    samples = [task.result() for task in tasks]  # canonical order: the tickets'
    manifest.trained(step, [s.sample_id for s in samples])
    return train(weights, [s.reward or 0.0 for s in samples])


JOB = StandInJob()
