"""Fuzz: garbage from a raw pyzmq socket is refused, answered, counted exactly and logged
sparingly, and the bus keeps serving everyone else.

10,000 garbage messages in CI; 100,000 under ``HYPOTHESIS_PROFILE=nightly``. Each is
built to break the protocol in one known way, so the expected count per reason is exact.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest
import zmq

from dynarl.bus import BusClient, BusConfig, BusServer
from dynarl.bus._loop import SyncBridge
from dynarl.bus._messages import PROTOCOL_VERSION, Ping, Pong

LIMIT = 4096
CONFIG = BusConfig(max_message_bytes=LIMIT, heartbeat_interval_s=0.5, log_interval_s=10.0)
COUNT = 100_000 if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else 10_000
BATCH = 200


def pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def text(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijXYZ_-") for _ in range(rng.randint(1, 12)))


def garbage(rng: random.Random) -> tuple[str, list[bytes], int]:
    """(expected reason, frames, request id the error reply must carry)."""
    rid = rng.randint(1, 2**40)
    choice = rng.randrange(8)
    if choice == 0:
        frames = [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(2, 4))]
        return "frame_count", frames, 0
    if choice == 1:
        return "oversize", [rng.randbytes(rng.randint(LIMIT + 1, 2 * LIMIT - 64))], 0
    if choice == 2:
        junk = rng.choice(
            [
                b"\xc1" + rng.randbytes(rng.randint(0, 30)),  # never valid MessagePack
                pack(rng.choice([rng.randint(-9, 9), text(rng), {"a": 1}, [1, 2], None])),
                pack([1, -rid, 0, None]),
                b"",
            ]
        )
        return "malformed", [junk], 0
    if choice == 3:
        kind = rng.choice([0, *range(5, 256)])
        return "unknown_kind", [pack([kind, rid, 0, {"type": "Ping"}])], rid
    if choice == 4:
        body = {"type": "X" + text(rng), "seq": rng.randint(0, 9)}
        return "unknown_tag", [pack([1, rid, rng.randint(0, 9999), body])], rid
    if choice == 5:
        body = rng.choice(
            [
                {"type": "Ping", "seq": text(rng)},
                {"type": "Sample", "sample_id": 7, "token_ids": b"", "prompt_len": 0},
                {"type": "WorkerMetrics", "component": "c"},
                {"type": "Interrupt", "component": None},
            ]
        )
        return "invalid", [pack([rng.choice([1, 3]), rid, 0, body])], rid
    if choice == 6:
        return "not_registered", [pack([1, rid, 1000, {"type": "Ping", "seq": 1}])], rid
    body = {"type": "Register", "protocol": PROTOCOL_VERSION + 1 + rng.randint(0, 99), "name": "f"}
    return "protocol_version", [pack([1, rid, 1000, body])], rid


@contextmanager
def served() -> Iterator[tuple[SyncBridge, BusServer]]:
    with SyncBridge() as bridge:
        server = bridge.run(BusServer(config=CONFIG).start(), timeout=30)
        try:
            yield bridge, server
        finally:
            bridge.run(server.aclose(), timeout=30)


@contextmanager
def raw_dealer(address: str) -> Iterator[zmq.Socket[bytes]]:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    socket.rcvtimeo = 10_000
    socket.connect(address)
    try:
        yield socket
    finally:
        socket.close(linger=0)
        context.term()


def ping_through(bridge: SyncBridge, address: str, name: str) -> Pong:
    async def ping() -> Pong:
        async with BusClient(address, name=name, config=CONFIG) as client:
            reply: Pong = await client.request(Ping(seq=42), timeout=10)
            return reply

    return bridge.run(ping(), timeout=30)


def test_garbage_is_refused_counted_and_answered(caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(20260509)
    expected: Counter[str] = Counter()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dynarl.bus"), served() as (bridge, server):
        with raw_dealer(server.address) as fuzzer:
            for first in range(0, COUNT, BATCH):
                sent = [garbage(rng) for _ in range(min(BATCH, COUNT - first))]
                for reason, frames, _ in sent:
                    fuzzer.send_multipart(frames)
                    expected[reason] += 1
                for reason, _, rid in sent:
                    kind, reply_id, _, body = msgpack.unpackb(fuzzer.recv(), raw=False)
                    assert (kind, reply_id, body["type"]) == (2, rid, "ErrorReply")
                    assert body["code"] == reason, body
                if first % (BATCH * 10) == 0:  # others are still served meanwhile
                    assert ping_through(bridge, server.address, f"bystander-{first}").seq == 42
        assert ping_through(bridge, server.address, "after").seq == 42
        bad = dict(bridge.run(_bad_frames(server), timeout=10))
    elapsed = time.monotonic() - started
    assert sum(expected.values()) == COUNT
    assert bad == dict(expected)
    lines = [r for r in caplog.records if "refused a frame" in r.getMessage()]
    assert 0 < len(lines) <= len(expected) * (1 + elapsed / CONFIG.log_interval_s)


async def _bad_frames(server: BusServer) -> Counter[str]:
    return Counter(server.stats.bad_frames)


def test_frames_beyond_zeromqs_limit_cost_only_the_senders_connection() -> None:
    with served() as (bridge, server), raw_dealer(server.address) as fuzzer:
        fuzzer.send(b"\x00" * (3 * LIMIT))  # above MAXMSGSIZE: ZeroMQ drops the connection
        assert ping_through(bridge, server.address, "bystander").seq == 42
        assert bridge.run(_bad_frames(server), timeout=10) == Counter()
        assert fuzzer.poll(200) == 0  # no reply: the frame never reached the bus
