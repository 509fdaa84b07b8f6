"""Benchmark of the dynarl bus against a bare zmq.asyncio floor, plus codec costs.

Two server processes are started on loopback: a bare ``zmq.asyncio`` ROUTER echo (the
floor: no dynarl imported in that process) and a ``dynarl.bus.BusServer`` answering
``Ping`` with ``Pong``. This process is the client of both, on the same event-loop
implementation (uvloop when installed). Rounds alternate floor and bus; each round
measures the round-trip time with one request outstanding and the throughput with 100
requests in flight (one request per message, no batching). Figures are medians over
rounds. The bus answers ``Ping`` with a plain-function handler (run inline, no task per
request); the ``task_per_request_*`` figures are the same measurement with a coroutine
handler, which the bus runs as one task per request. Then the typed codec: encode+decode
of a ``WorkerMetrics`` report (nine scalar fields) through the control channel's typed
decoder, and of a 4,096-token ``Sample`` whose token ids are packed from and unpacked to
an int32 numpy array (minimum over repeats; medians reported too).

    .venv/bin/python bench/bus.py [--rounds 5]

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

PAYLOAD = b"x" * 24  # about the size of an encoded Ping frame


def new_loop(name: str) -> asyncio.AbstractEventLoop:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_on(name: str, main: Coroutine[Any, Any, Any]) -> Any:
    with asyncio.Runner(loop_factory=lambda: new_loop(name)) as runner:
        return runner.run(main)


# ----------------------------------------------------------------------------- servers


async def serve_floor() -> None:
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    socket = context.socket(zmq.ROUTER)
    socket.linger = 0
    socket.bind("tcp://127.0.0.1:*")
    print(socket.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    try:
        while True:
            await socket.send_multipart(await socket.recv_multipart())
    finally:
        socket.close(linger=0)
        context.term()


async def serve_bus() -> None:
    from dynarl.bus import BusServer, Interrupt, Peer
    from dynarl.bus._messages import Ack

    async def spawned(message: Interrupt, peer: Peer) -> Ack:
        return Ack()  # a coroutine handler: the bus runs it as a task per request

    async with BusServer(name="bench") as server:
        server.route(Interrupt, spawned)
        print(server.address, flush=True)
        await asyncio.Event().wait()


# ----------------------------------------------------------------------------- clients


async def floor_client(address: str, rtt_n: int, tput_n: int, inflight: int) -> dict[str, float]:
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(address)
    try:
        for _ in range(200):  # warm up the connection
            await socket.send(PAYLOAD)
            await socket.recv()
        samples = []
        for _ in range(rtt_n):
            start = time.perf_counter_ns()
            await socket.send(PAYLOAD)
            await socket.recv()
            samples.append(time.perf_counter_ns() - start)
        start = time.perf_counter()
        for _ in range(inflight):
            await socket.send(PAYLOAD)
        sent, received = inflight, 0
        while received < tput_n:
            await socket.recv()
            received += 1
            if sent < tput_n:
                await socket.send(PAYLOAD)
                sent += 1
        elapsed = time.perf_counter() - start
    finally:
        socket.close(linger=0)
        context.term()
    return summarize(samples, tput_n / elapsed)


async def bus_client(
    address: str, rtt_n: int, tput_n: int, inflight: int, spawn: bool = False
) -> dict[str, float]:
    from dynarl.bus import BusClient, Interrupt
    from dynarl.bus._messages import Ping

    def message(seq: int) -> object:
        return Interrupt(component="bench") if spawn else Ping(seq=seq)

    async with BusClient(address, name=f"bench-{os.getpid()}") as client:
        for seq in range(200):
            await client.request(message(seq))
        samples = []
        for seq in range(rtt_n):
            start = time.perf_counter_ns()
            await client.request(message(seq))
            samples.append(time.perf_counter_ns() - start)
        remaining = [tput_n]

        async def worker() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                await client.request(message(remaining[0]))

        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(inflight):
                group.create_task(worker())
        elapsed = time.perf_counter() - start
    return summarize(samples, tput_n / elapsed)


def summarize(samples_ns: list[int], rps: float) -> dict[str, float]:
    ordered = sorted(samples_ns)
    return {
        "p50_us": ordered[len(ordered) // 2] / 1e3,
        "p99_us": ordered[int(len(ordered) * 0.99)] / 1e3,
        "rps": rps,
    }


# ----------------------------------------------------------------------------- codec


def per_op_us(work: Callable[[], object], iterations: int, repeats: int = 9) -> tuple[float, float]:
    """(min, median) over repeats of the mean time per call, microseconds.

    The minimum is the figure reported (as ``timeit`` advises: other processes on the
    shared cores only ever add time); the median is reported next to it.
    """
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            work()
        timings.append((time.perf_counter() - start) / iterations * 1e6)
    return min(timings), statistics.median(timings)


def codec_figures() -> dict[str, float]:
    from dynarl.bus import MessageCodec, Sample, WorkerMetrics, pack_tokens, unpack_tokens
    from dynarl.bus._messages import ControlMessage, DataMessage

    control: MessageCodec[Any] = MessageCodec(ControlMessage, 1 << 24)
    data: MessageCodec[Any] = MessageCodec(DataMessage, 1 << 24)
    report = WorkerMetrics(
        component="rollout",
        worker=3,
        time=1234.5,
        interval_s=1.0,
        utilization=0.42,
        queue_depth=17,
        completed=120,
        in_flight=8,
        interruptible=True,
    )
    assert control.decode(control.encode(report)) == report
    tokens = np.arange(4096, dtype=np.int32) * 7 % 151_000

    def sample_round_trip() -> object:
        sample = Sample(
            sample_id="step-12/prompt-301/3",
            token_ids=pack_tokens(tokens),
            prompt_len=512,
            prompt_id="prompt-301",
            reward=1.0,
            policy_version=12,
        )
        decoded = data.decode(data.encode(sample))
        return unpack_tokens(decoded.token_ids)

    assert np.array_equal(sample_round_trip(), tokens)  # type: ignore[arg-type]
    codec = per_op_us(lambda: control.decode(control.encode(report)), 100_000)
    sample_codec = per_op_us(sample_round_trip, 20_000)
    return {
        "codec_us": codec[0],
        "codec_median_us": codec[1],
        "sample_codec_us": sample_codec[0],
        "sample_codec_median_us": sample_codec[1],
    }


# ----------------------------------------------------------------------------- main


def start_server(role: str, loop: str) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, DYNARL_EVENT_LOOP=loop)
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", role, "--loop", loop],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    address = process.stdout.readline().strip()
    if not address.startswith("tcp://"):
        process.kill()
        process.wait(10)
        raise RuntimeError(f"{role} server did not start")
    return process, address


def stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", choices=["floor", "bus"])
    parser.add_argument("--loop", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rtt-n", type=int, default=3000)
    parser.add_argument("--tput-n", type=int, default=20_000)
    parser.add_argument("--inflight", type=int, default=100)
    args = parser.parse_args()
    if args.serve:
        serve = serve_floor if args.serve == "floor" else serve_bus
        try:
            run_on(args.loop, serve())
        except KeyboardInterrupt:
            pass
        return 0

    from dynarl.bus._loop import loop_name

    loop = loop_name()
    floor_proc, floor_address = start_server("floor", loop)
    bus_proc, bus_address = start_server("bus", loop)
    rounds: dict[str, list[dict[str, float]]] = {"floor": [], "bus": [], "spawn": []}
    clients = {
        "floor": lambda: floor_client(floor_address, args.rtt_n, args.tput_n, args.inflight),
        "bus": lambda: bus_client(bus_address, args.rtt_n, args.tput_n, args.inflight),
        "spawn": lambda: bus_client(bus_address, args.rtt_n, args.tput_n, args.inflight, True),
    }
    try:
        for index in range(args.rounds):
            for role, client in clients.items():
                figures = run_on(loop, client())
                rounds[role].append(figures)
                print(
                    f"round {index} {role:5s} "
                    + " ".join(f"{k}={v:,.1f}" for k, v in figures.items())
                )
    finally:
        stop(floor_proc)
        stop(bus_proc)

    def median(role: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[role])

    def spread(role: str, key: str) -> list[float]:
        values = [r[key] for r in rounds[role]]
        return [round(min(values), 1), round(max(values), 1)]

    result: dict[str, Any] = {
        "loop": loop,
        "rounds": args.rounds,
        "floor_rtt_p50_us": median("floor", "p50_us"),
        "rtt_p50_us": median("bus", "p50_us"),
        "rtt_p99_us": median("bus", "p99_us"),
        "floor_throughput_rps": median("floor", "rps"),
        "throughput_rps": median("bus", "rps"),
        "floor_rtt_p50_spread_us": spread("floor", "p50_us"),
        "rtt_p50_spread_us": spread("bus", "p50_us"),
        "floor_throughput_spread_rps": spread("floor", "rps"),
        "throughput_spread_rps": spread("bus", "rps"),
        "task_per_request_rtt_p50_us": median("spawn", "p50_us"),
        "task_per_request_throughput_rps": median("spawn", "rps"),
    }
    result["rtt_ratio_to_floor"] = result["rtt_p50_us"] / result["floor_rtt_p50_us"]
    result["throughput_ratio_to_floor"] = result["throughput_rps"] / result["floor_throughput_rps"]
    result.update(codec_figures())
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
