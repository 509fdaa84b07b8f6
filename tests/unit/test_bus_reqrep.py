"""Request/reply over both transports: registration, deadlines, cancellation, errors, loss."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from dynarl.bus import BusClient, BusConfig, BusServer, Interrupt, PeerEvent, WorkerMetrics, run
from dynarl.bus._codec import Frame, FrameCodec
from dynarl.bus._inproc import MemDealer
from dynarl.bus._messages import (
    PROTOCOL_VERSION,
    Ack,
    ErrorReply,
    Heartbeat,
    Ping,
    Pong,
    Register,
    Welcome,
)
from dynarl.bus._peers import Peer
from dynarl.errors import BusError, DeadlineExceeded, PeerLostError, ProtocolError, RemoteError

FAST = BusConfig(heartbeat_interval_s=0.05, num_missed_heartbeats=2, default_timeout_s=10.0)
_names = itertools.count()


def drive(main: Awaitable[Any], seconds: float = 30.0) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(seconds):
            return await main

    return run(bounded())


def address(transport: str) -> str:
    return f"mem://reqrep-{next(_names)}" if transport == "mem" else "tcp://127.0.0.1:0"


@asynccontextmanager
async def pair(
    transport: str, config: BusConfig = FAST, **server_kwargs: Any
) -> AsyncIterator[tuple[BusServer, BusClient]]:
    async with BusServer(address(transport), config=config, **server_kwargs) as server:
        async with BusClient(server.address, name="w0", config=config, role="worker") as client:
            yield server, client


class Blocker:
    """An async handler that waits until released and records cancellations."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def __call__(self, message: Interrupt, peer: Peer) -> Ack:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Ack(detail=message.component)


TRANSPORTS = ["mem", "tcp"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_register_ping_and_settings(transport: str) -> None:
    events: list[PeerEvent] = []

    async def main() -> None:
        async with pair(transport, on_peer=events.append) as (server, client):
            assert server.peers() == ["w0"]
            peer = server.peer("w0")
            assert peer is not None and peer.role == "worker"
            assert client.welcome is not None
            assert client.welcome.heartbeat_interval_s == FAST.heartbeat_interval_s
            assert client.server_name == "controller"
            assert await client.request(Ping(seq=3, payload=b"hi")) == Pong(seq=3, payload=b"hi")
            assert await server.request("w0", Ping(seq=4)) == Pong(seq=4)
        names = [event.event for event in events]
        # Unregister is best effort over ZeroMQ (closing with linger=0 may drop it); in
        # process it always arrives.
        assert names == ["registered", "left"] if transport == "mem" else names[0] == "registered"

    drive(main())


def test_a_client_that_leaves_says_why() -> None:
    events: list[PeerEvent] = []

    async def main() -> None:
        async with BusServer(address("mem"), config=FAST, on_peer=events.append) as server:
            async with BusClient(server.address, name="w0", config=FAST) as plain:
                assert plain.leave_reason == ""
            async with BusClient(server.address, name="w1", config=FAST) as told:
                told.leave_reason = "its engine died"

    drive(main())
    left = {event.peer: event.reason for event in events if event.event == "left"}
    assert left == {"w0": "closed", "w1": "its engine died"}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deadline_fails_the_caller_and_cancels_the_remote_handler(transport: str) -> None:
    async def main() -> None:
        async with pair(transport) as (server, client):
            blocker = Blocker()
            server.route(Interrupt, blocker)
            with pytest.raises(DeadlineExceeded):
                await client.request(Interrupt(component="x"), timeout=0.05)
            await blocker.cancelled.wait()
            # the other direction too
            other = Blocker()
            client.route(Interrupt, other)
            with pytest.raises(DeadlineExceeded):
                await server.request("w0", Interrupt(component="y"), timeout=0.05)
            await other.cancelled.wait()
            assert await client.request(Ping(seq=1)) == Pong(seq=1)

    drive(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cancelling_the_caller_cancels_the_remote_handler(transport: str) -> None:
    async def main() -> None:
        async with pair(transport) as (server, client):
            blocker = Blocker()
            server.route(Interrupt, blocker)
            task = asyncio.create_task(client.request(Interrupt(component="x"), timeout=60))
            await blocker.started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await blocker.cancelled.wait()
            assert server.peer("w0") is not None and not server.peer("w0").running  # type: ignore[union-attr]

    drive(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_replies_correlate_with_concurrent_requests(transport: str) -> None:
    async def main() -> None:
        async with pair(transport) as (server, client):

            async def echo_later(message: Ping, peer: Peer) -> Pong:
                await asyncio.sleep((message.seq % 7) * 0.001)
                return Pong(seq=message.seq)

            server.route(Ping, echo_later)
            replies = await asyncio.gather(*(client.request(Ping(seq=n)) for n in range(200)))
            assert [reply.seq for reply in replies] == list(range(200))

    drive(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_handler_failures_become_error_replies(transport: str) -> None:
    def fail(message: Interrupt, peer: Peer) -> Ack:
        if message.component == "value":
            raise ValueError("bad component")
        raise RuntimeError("boom")

    async def main() -> None:
        async with pair(transport) as (server, client):
            server.route(Interrupt, fail)
            with pytest.raises(RemoteError, match="bad_request: ValueError: bad component"):
                await client.request(Interrupt(component="value"))
            with pytest.raises(RemoteError, match="handler_error: RuntimeError: boom") as info:
                await client.request(Interrupt(component="other"))
            assert info.value.code == "handler_error"
            server.route(Interrupt, lambda message, peer: "not a message")
            with pytest.raises(RemoteError, match="not a bus message"):
                await client.request(Interrupt(component="x"))
            with pytest.raises(ProtocolError, match="no_handler"):
                await client.request(
                    WorkerMetrics(component="c", worker=0, time=0, interval_s=1, utilization=0)
                )
            assert server.stats.handler_errors == 3
            assert await client.request(Ping()) == Pong()

    drive(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_notifications_reach_handlers(transport: str) -> None:
    async def main() -> None:
        async with pair(transport) as (server, client):
            got: asyncio.Queue[WorkerMetrics] = asyncio.Queue()
            server.route(WorkerMetrics, lambda message, peer: got.put_nowait(message))
            report = WorkerMetrics(
                component="c", worker=1, time=2.0, interval_s=1.0, utilization=0.3
            )
            assert client.notify(report)
            assert await got.get() == report

    drive(main())


def test_leaving_fails_what_waits_on_the_peer() -> None:
    async def main() -> None:
        async with BusServer(address("mem"), config=FAST) as server:
            client = await BusClient(server.address, name="w0", config=FAST).start()
            blocker = Blocker()
            client.route(Interrupt, blocker)
            waiting = asyncio.create_task(
                server.request("w0", Interrupt(component="x"), timeout=60)
            )
            await blocker.started.wait()
            await client.aclose()
            with pytest.raises(PeerLostError, match="left"):
                await waiting
            assert server.peers() == []
            with pytest.raises(PeerLostError, match="is registered"):
                await server.request("w0", Ping())

    drive(main())


async def raw_register(dealer: MemDealer, name: str) -> None:
    codec = FrameCodec(FAST.max_message_bytes)
    dealer.send_frames([codec.encode(1, 1, 1000, Register(protocol=PROTOCOL_VERSION, name=name))])
    (reply,) = await dealer.recv()
    frame = codec.decode(reply)
    assert isinstance(frame, Frame) and isinstance(frame.body, Welcome), frame


def test_a_silent_peer_is_lost_and_its_waiters_fail() -> None:
    async def main() -> None:
        async with BusServer(address("mem"), config=FAST) as server:
            silent = MemDealer(server.address, FAST)
            await raw_register(silent, "mute")
            assert server.peers() == ["mute"]
            with pytest.raises(PeerLostError, match="lost"):
                await server.request("mute", Ping(), timeout=60)
            assert server.stats.peers_lost == 1 and server.peers() == []
            await silent.aclose()

    drive(main())


def test_the_client_detects_a_lost_server() -> None:
    async def main() -> None:
        lost = asyncio.Event()
        async with BusServer(address("mem"), config=FAST) as server:
            client = await BusClient(
                server.address, name="w0", config=FAST, on_lost=lost.set
            ).start()
            server.route(Interrupt, Blocker())
            waiting = asyncio.create_task(client.request(Interrupt(component="x"), timeout=60))
            await asyncio.sleep(0.01)
        with pytest.raises(PeerLostError):
            await waiting
        await lost.wait()
        assert client.lost
        with pytest.raises(PeerLostError):
            await client.request(Ping())
        await client.aclose()

    drive(main())


def test_registering_again_displaces_the_old_connection() -> None:
    async def main() -> None:
        async with BusServer(address("mem"), config=FAST) as server:
            first = MemDealer(server.address, FAST)
            await raw_register(first, "dup")
            waiting = asyncio.create_task(server.request("dup", Ping(), timeout=60))
            await asyncio.sleep(0)
            second = MemDealer(server.address, FAST)
            await raw_register(second, "dup")
            with pytest.raises(PeerLostError, match="registered again"):
                await waiting
            assert server.peers() == ["dup"]
            for dealer in (first, second):
                await dealer.aclose()

    drive(main())


def test_strangers_and_bad_versions_are_refused() -> None:
    async def main() -> None:
        async with BusServer(address("mem"), config=FAST) as server:
            codec = FrameCodec(FAST.max_message_bytes)
            dealer = MemDealer(server.address, FAST)
            dealer.send_frames([codec.encode(1, 5, 0, Ping())])
            dealer.send_frames([codec.encode(1, 6, 0, Register(protocol=99, name="x"))])
            dealer.send_frames([codec.encode(3, 0, 0, Heartbeat(seq=1))])
            replies = [codec.decode((await dealer.recv())[0]) for _ in range(3)]
            bodies = [(reply.request_id, reply.body) for reply in replies]  # type: ignore[union-attr]
            assert [rid for rid, _ in bodies] == [5, 6, 0]
            codes = [body.code for _, body in bodies if isinstance(body, ErrorReply)]
            assert codes == ["not_registered", "protocol_version", "not_registered"]
            assert "unsupported protocol version 99" in bodies[1][1].message  # type: ignore[union-attr]
            assert server.stats.bad_frames == {"not_registered": 2, "protocol_version": 1}
            assert server.peers() == []
            await dealer.aclose()

    drive(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_closing_fails_pending_requests(transport: str) -> None:
    async def main() -> None:
        async with BusServer(address(transport), config=FAST) as server:
            async with BusClient(server.address, name="w0", config=FAST) as client:
                client.route(Interrupt, Blocker())
                waiting = asyncio.create_task(server.request("w0", Interrupt(component="x")))
                await asyncio.sleep(0.01)
                await server.aclose()
                with pytest.raises(BusError, match="closed"):
                    await waiting
                with pytest.raises(BusError, match="closed"):
                    await server.request("w0", Ping())

    drive(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_request_waits_for_a_missed_wake_up(transport: str) -> None:
    """Sequential and concurrent traffic in both directions, with heartbeats too rare to
    wake a stalled loop: a missed socket wake-up would surface as a DeadlineExceeded."""
    quiet = BusConfig(heartbeat_interval_s=60.0, default_timeout_s=5.0)

    async def main() -> None:
        async with pair(transport, quiet) as (server, client):
            for seq in range(600):
                assert (await client.request(Ping(seq=seq))).seq == seq
                if seq % 5 == 0:
                    assert (await server.request("w0", Ping(seq=seq))).seq == seq

            async def calls(count: int, call: Callable[[int], Awaitable[Any]]) -> None:
                for seq in range(count):
                    assert (await call(seq)).seq == seq

            async with asyncio.TaskGroup() as group:
                for _ in range(20):
                    group.create_task(calls(40, lambda n: client.request(Ping(seq=n))))
                    group.create_task(calls(10, lambda n: server.request("w0", Ping(seq=n))))

    drive(main(), 120)


def test_the_client_adopts_the_servers_smaller_size_limit() -> None:
    async def main() -> None:
        small = BusConfig(max_message_bytes=1024, heartbeat_interval_s=0.05)
        async with BusServer(address("mem"), config=small) as server:
            async with BusClient(server.address, name="w0", config=FAST) as client:
                # refused by the client's own encoder, before anything is sent
                with pytest.raises(
                    ProtocolError, match=r"a Ping frame of .* max_message_bytes=1024"
                ):
                    await client.request(Ping(payload=b"x" * 2000))
                assert await client.request(Ping(payload=b"x" * 900)) == Pong(payload=b"x" * 900)

    drive(main())


class _Unqueueable(BusClient):
    """A client whose link cannot queue its first ``refusals`` frames (ZeroMQ between a
    refused handshake and the reconnect: no pipe to queue on)."""

    def __init__(self, *args: Any, refusals: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusals = refusals

    def _out(self, key: bytes, data: bytes) -> bool:
        if self.refusals > 0:
            self.refusals -= 1
            return False
        return super()._out(key, data)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_registration_outlasts_a_link_that_cannot_queue_yet(transport: str) -> None:
    config = BusConfig(heartbeat_interval_s=0.05, register_timeout_s=2.0)

    async def main() -> None:
        async with BusServer(address(transport), config=config) as server:
            late = _Unqueueable(server.address, name="late", config=config, refusals=3)
            async with late:
                assert late.refusals == 0 and server.peers() == ["late"]
            never = _Unqueueable(server.address, name="never", config=config, refusals=10**9)
            # The same refusal as a Register never answered: DeadlineExceeded, not a
            # different error depending on when ZeroMQ dropped the refused connection.
            with pytest.raises(DeadlineExceeded, match="did not answer Register"):
                await never.start()
            assert never.refusals < 10**9

    drive(main())
