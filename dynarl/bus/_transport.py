"""Frame links: ZeroMQ sockets (``tcp://``, ``ipc://``) or in-process queues (``mem://``).

A link moves whole frames and nothing else; request ids, deadlines and heartbeats live
above it (``dynarl.bus._endpoint``). Every ZeroMQ link owns its ``zmq.asyncio`` context,
closes its socket with ``linger=0``, enforces ZeroMQ's ``MAXMSGSIZE`` and, when binding
an address other than loopback, requires CURVE.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

import zmq
import zmq.asyncio

from dynarl.bus._bus_config import BusConfig
from dynarl.bus._curve import CurveClient, CurveServer, Guard, apply_client
from dynarl.bus._inproc import MemDealer, MemPublisher, MemRouter, MemSubscriber

__all__ = [
    "DealerLink",
    "PubLink",
    "RouterLink",
    "SubLink",
    "check_bind_address",
    "open_dealer",
    "open_publisher",
    "open_router",
    "open_subscriber",
]

logger = logging.getLogger(__name__)


class RouterLink(Protocol):
    """The binding end of request/reply (server side)."""

    address: str

    def recv(self) -> asyncio.Future[list[bytes]]:
        """The next message: ``[routing id, *frames]`` (a finished future if one is queued)."""
        ...

    def recv_nowait(self) -> list[bytes] | None:
        """The next message if one is queued, else None (receive loop only)."""
        ...

    def send(self, peer: bytes, frame: bytes) -> bool:
        """Send one frame to ``peer`` without waiting; False if unroutable or full."""
        ...

    def send_direct(self, peer: bytes, frame: bytes) -> bool:
        """Like :meth:`send`, cheaper, but only while no :meth:`recv` is pending."""
        ...

    async def serve(self) -> None:
        """Background work the link needs while open (CURVE authentication)."""
        ...

    async def aclose(self) -> None:
        """Close the link."""
        ...


class DealerLink(Protocol):
    """The connecting end of request/reply (client side)."""

    address: str

    def recv(self) -> asyncio.Future[list[bytes]]:
        """The next message: ``[*frames]`` (a finished future if one is queued)."""
        ...

    def recv_nowait(self) -> list[bytes] | None:
        """The next message if one is queued, else None (receive loop only)."""
        ...

    def send_nowait(self, frame: bytes) -> bool:
        """Send one frame without waiting; False if the outgoing queue is full."""
        ...

    def send_direct(self, frame: bytes) -> bool:
        """Like :meth:`send_nowait`, cheaper, but only while no :meth:`recv` is pending."""
        ...

    async def serve(self) -> None:
        """Background work the link needs while open."""
        ...

    async def aclose(self) -> None:
        """Close the link."""
        ...


class PubLink(Protocol):
    """The binding end of publish/subscribe."""

    address: str

    def send(self, topic: bytes, frame: bytes) -> bool:
        """Publish without waiting; False if dropped."""
        ...

    async def serve(self) -> None:
        """Background work the link needs while open (CURVE authentication)."""
        ...

    async def aclose(self) -> None:
        """Close the link."""
        ...


class SubLink(Protocol):
    """The connecting end of publish/subscribe."""

    def subscribe(self, prefix: bytes) -> None:
        """Receive topics starting with ``prefix``."""
        ...

    def recv(self) -> Awaitable[list[bytes]]:
        """The next message: ``[topic, *frames]``."""
        ...

    async def serve(self) -> None:
        """Background work the link needs while open."""
        ...

    async def aclose(self) -> None:
        """Close the link."""
        ...


def _scheme(address: str) -> str:
    scheme, sep, _ = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc", "mem"):
        raise ValueError(
            f"bus address must be tcp://, ipc://, inproc:// or mem://, got {address!r}"
        )
    return scheme


def check_bind_address(address: str, *, secured: bool) -> str:
    """The address to bind (``:0`` becomes ZeroMQ's random port ``:*``).

    Raises ValueError for an unsupported scheme, or for a routable TCP address when
    ``secured`` is false: only loopback may be bound without CURVE.
    """
    if _scheme(address) != "tcp":
        return address
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not port:
        raise ValueError(f"tcp bus address needs host:port, got {address!r}")
    bare = host.strip("[]")
    try:
        loopback = bare == "localhost" or ipaddress.ip_address(bare).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not secured:
        raise ValueError(
            f"binding the routable address {address!r} requires CURVE "
            "(pass curve=CurveServer(...)); only loopback binds without it"
        )
    return f"tcp://{host}:*" if port in ("0", "*") else address


def _socket(context: zmq.asyncio.Context, kind: int, config: BusConfig) -> zmq.asyncio.Socket:
    socket = context.socket(kind)
    socket.linger = 0
    socket.sndhwm = config.send_hwm
    socket.rcvhwm = config.recv_hwm
    socket.setsockopt(zmq.MAXMSGSIZE, config.zmq_max_message_bytes)
    return socket


class _ZmqLink:
    """A ZeroMQ socket with its own context (and ZAP guard when it is a CURVE server)."""

    def __init__(self, kind: int, config: BusConfig, curve: CurveServer | None) -> None:
        self._context = zmq.asyncio.Context()
        self._guard: Guard | None = None
        try:
            self._guard = Guard(self._context, curve) if curve is not None else None
            self._socket = _socket(self._context, kind, config)
            if self._guard is not None:
                self._guard.apply(self._socket)
        except BaseException:
            self._close()
            raise
        self.address = ""

    def _bind(self, address: str) -> None:
        try:
            self._socket.bind(check_bind_address(address, secured=self._guard is not None))
        except BaseException:
            self._close()
            raise
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def _connect(self, address: str) -> None:
        _scheme(address)
        try:
            self._socket.connect(address)
        except BaseException:
            self._close()
            raise
        self.address = address

    async def serve(self) -> None:
        """Answer CURVE authentication requests while the link is open."""
        if self._guard is not None:
            await self._guard.serve()

    def _close(self) -> None:
        socket = getattr(self, "_socket", None)
        if socket is not None:
            socket.close(linger=0)
        if self._guard is not None:
            self._guard.close()
        self._context.term()

    async def aclose(self) -> None:
        """Close the socket (pending messages are dropped) and terminate the context."""
        if not self._context.closed:
            self._close()


def _sent(future: Any) -> bool:
    # A non-blocking send on zmq.asyncio returns an already-finished future.
    if not future.done():  # pragma: no cover - only while a blocking send is queued
        future.add_done_callback(lambda done: done.exception())
        return True
    return future.exception() is None


class _Fast(_ZmqLink):
    """A link whose owner may bypass ``zmq.asyncio`` when it is safe, for speed.

    :meth:`recv_nowait` and ``send_direct`` are non-blocking calls on a synchronous
    shadow of the socket, a fraction of the cost of a ``zmq.asyncio`` call (measured in
    ``bench/bus.py``). They are safe only while no ``zmq.asyncio`` receive is pending on
    the socket (a pending one could miss its edge-triggered wake-up), which the endpoint
    tracks; this link never blocks on a send, so no ``zmq.asyncio`` send is ever pending.
    """

    def _shadow(self) -> None:
        self._sync: zmq.Socket[bytes] = zmq.Socket.shadow(self._socket.underlying)
        self._recv_sync = self._sync.recv_multipart

    def recv(self) -> asyncio.Future[list[bytes]]:
        """The next message (a finished future if one is queued)."""
        future = self._socket.recv_multipart()
        assert isinstance(future, asyncio.Future)
        return future

    def recv_nowait(self) -> list[bytes] | None:
        """The next message if one is queued, else None (receive loop only)."""
        try:
            frames: list[bytes] = self._recv_sync(zmq.NOBLOCK)
        except zmq.Again:
            return None
        return frames


class ZmqRouter(_Fast):
    """ROUTER socket: replies never block the loop; an unroutable peer is an error."""

    def __init__(self, address: str, config: BusConfig, curve: CurveServer | None) -> None:
        super().__init__(zmq.ROUTER, config, curve)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._bind(address)
        self._shadow()
        self._send_sync = self._sync.send_multipart

    def send(self, peer: bytes, frame: bytes) -> bool:
        """Send one frame to ``peer`` without waiting; False if unroutable or full."""
        return _sent(self._socket.send_multipart((peer, frame), zmq.NOBLOCK))

    def send_direct(self, peer: bytes, frame: bytes) -> bool:
        """Like :meth:`send`, only while no :meth:`recv` is pending."""
        try:
            self._send_sync((peer, frame), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True


class ZmqDealer(_Fast):
    """DEALER socket connected to one server (its routing id is the client's name)."""

    def __init__(
        self, address: str, config: BusConfig, curve: CurveClient | None, identity: bytes
    ) -> None:
        super().__init__(zmq.DEALER, config, None)
        if curve is not None:
            apply_client(self._socket, curve)
        self._socket.setsockopt(zmq.ROUTING_ID, identity)
        self._connect(address)
        self._shadow()
        self._send_sync = self._sync.send

    def send_nowait(self, frame: bytes) -> bool:
        """Send one frame without waiting; False if the outgoing queue is full."""
        return _sent(self._socket.send(frame, zmq.NOBLOCK))

    def send_direct(self, frame: bytes) -> bool:
        """Like :meth:`send_nowait`, only while no :meth:`recv` is pending."""
        try:
            self._send_sync(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True


class ZmqPublisher(_ZmqLink):
    """PUB socket: publishing never blocks; slow subscribers miss messages."""

    def __init__(self, address: str, config: BusConfig, curve: CurveServer | None) -> None:
        super().__init__(zmq.PUB, config, curve)
        self._bind(address)

    def send(self, topic: bytes, frame: bytes) -> bool:
        """Publish without waiting; False if dropped."""
        return _sent(self._socket.send_multipart((topic, frame), zmq.NOBLOCK))


class ZmqSubscriber(_ZmqLink):
    """SUB socket connected to one publisher."""

    def __init__(self, address: str, config: BusConfig, curve: CurveClient | None) -> None:
        super().__init__(zmq.SUB, config, None)
        if curve is not None:
            apply_client(self._socket, curve)
        self._connect(address)
        self.recv = self._socket.recv_multipart

    def subscribe(self, prefix: bytes) -> None:
        """Receive topics starting with ``prefix``."""
        self._socket.subscribe(prefix)


def open_router(address: str, config: BusConfig, curve: CurveServer | None = None) -> RouterLink:
    """Bind a request/reply server link. Raises ValueError for an unsafe address."""
    if _scheme(address) == "mem":
        return MemRouter(address, config)
    return ZmqRouter(address, config, curve)


def open_dealer(
    address: str, config: BusConfig, curve: CurveClient | None = None, identity: bytes = b""
) -> DealerLink:
    """Connect a request/reply client link; ``identity`` is its routing id (ZeroMQ only)."""
    if _scheme(address) == "mem":
        return MemDealer(address, config)
    return ZmqDealer(address, config, curve, identity)


def open_publisher(address: str, config: BusConfig, curve: CurveServer | None = None) -> PubLink:
    """Bind a publish link. Raises ValueError for an unsafe address."""
    if _scheme(address) == "mem":
        return MemPublisher(address, config)
    return ZmqPublisher(address, config, curve)


def open_subscriber(address: str, config: BusConfig, curve: CurveClient | None = None) -> SubLink:
    """Connect a subscribe link."""
    if _scheme(address) == "mem":
        return MemSubscriber(address, config)
    return ZmqSubscriber(address, config, curve)
