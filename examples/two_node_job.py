"""The job ``examples/torchrun_two_node.sh`` launches on every node: one controller, a
worker per rank, talking over dynarl's bus (CURVE-authenticated across nodes).

``torchrun ... -m dynarl.runtime.launch --job two_node_job:JOB`` imports this module on
every rank (``examples/`` on ``PYTHONPATH``). The launcher gives rank 0 a
:class:`~dynarl.runtime.launch.ControllerContext` (a bus address to bind, the CURVE
server settings, ``announce``) and every rank a :class:`~dynarl.runtime.launch.WorkerContext`
(the controller's address, the CURVE client settings); it rendezvouses the ranks over
torchrun's TCPStore and checks every node's public key against the allow-list.

The controller waits for every rank's worker, has them "generate" ``--samples`` requests
round-robin (dynarl's scripted tokens: a pure function of the sample id, so it checks each
answer), writes ``result.json`` into the job directory and stops the workers. Put your own
controller (``dynarl.runtime.Controller``) and roles here instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json

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
from dynarl.runtime.launch import ControllerContext, WorkerContext
from dynarl.testing import scripted_token

# Generous: freshly started ranks import torch on a loaded machine.
CONFIG = BusConfig(heartbeat_interval_s=1.0, num_missed_heartbeats=10, register_timeout_s=60.0)
VOCAB = 1000


def generate(request: GenerationRequest, rank: int) -> Sample:
    """A worker's answer: the scripted tokens of the request."""
    prompt = [int(t) for t in unpack_tokens(request.token_ids)]
    new = [
        scripted_token(0, request.sample_id, len(prompt) + k, VOCAB)
        for k in range(request.max_new_tokens)
    ]
    return Sample(
        sample_id=request.sample_id,
        token_ids=pack_tokens(prompt + new),
        prompt_len=len(prompt),
        metadata={"rank": rank},
    )


class TwoNodeJob:
    """A :class:`~dynarl.runtime.launch.LaunchedJob`: ``controller`` on rank 0,
    ``worker`` on every rank."""

    async def controller(self, context: ControllerContext) -> None:
        """Bind the bus, announce it, spread the requests, write ``result.json``."""
        parser = argparse.ArgumentParser(prog="two_node_job")
        parser.add_argument("--samples", type=int, default=8)
        options = parser.parse_args(list(context.config.args))
        joined = asyncio.Event()
        bus = BusServer(
            context.bind_address,
            curve=context.curve,
            config=CONFIG,
            on_peer=lambda event: joined.set(),
        )
        async with bus:
            context.announce(bus.address)
            async with asyncio.timeout(120):
                while len(bus.peers()) < context.env.world_size:
                    await joined.wait()
                    joined.clear()
            workers = bus.peers()
            requests = [
                GenerationRequest(
                    sample_id=f"s{i}", token_ids=pack_tokens([i, i + 1]), max_new_tokens=4
                )
                for i in range(options.samples)
            ]
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(bus.request(workers[i % len(workers)], r, timeout=30))
                    for i, r in enumerate(requests)
                ]
            samples: list[Sample] = [task.result() for task in tasks]
            wrong = [
                s.sample_id
                for s, r in zip(samples, requests, strict=True)
                if s.token_ids != generate(r, 0).token_ids
            ]
            result = {
                "workers": workers,
                "samples": len(samples),
                "by_rank": {
                    str(rank): sum(1 for s in samples if s.metadata.get("rank") == rank)
                    for rank in range(context.env.world_size)
                },
                "wrong": wrong,
                "curve": context.curve is not None,
            }
            (context.config.job_dir / "result.json").write_text(json.dumps(result))
            for name in workers:
                await bus.request(name, Interrupt(component="workers", reason="done"))

    async def worker(self, context: WorkerContext) -> None:
        """Serve generation requests until the controller says stop.

        Raises WorkerError if the controller is lost first."""
        done = asyncio.Event()
        stopped: list[Interrupt] = []

        def stop(message: Interrupt, peer: Peer) -> None:
            stopped.append(message)
            done.set()

        client = BusClient(
            context.address,
            name=context.name,
            config=CONFIG,
            curve=context.curve,
            on_lost=done.set,
        )
        client.route(GenerationRequest, lambda message, peer: generate(message, context.env.rank))
        client.route(Interrupt, stop)
        async with client:
            await done.wait()
        if not stopped:
            raise WorkerError(f"{context.name}: lost the controller")


JOB = TwoNodeJob()
