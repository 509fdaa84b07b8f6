"""``BusServer``: the binding end of request/reply (a ROUTER socket), with its peer registry.

The controller (and each group manager, for its workers) runs one. It registers clients
(``Register`` → ``Welcome``, refusing unsupported protocol versions), echoes their
heartbeats, declares silent ones lost, serves requests with the handlers given to
:meth:`~dynarl.bus._endpoint.Endpoint.route`, sends requests to any registered client, and
hosts the channel queues of :class:`~dynarl.bus.Channel`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

from dynarl._resource import AsyncResource
from dynarl.bus._bus_config import BusConfig
from dynarl.bus._channel import ChannelTable
from dynarl.bus._codec import Frame, Refusal
from dynarl.bus._curve import CurveServer
from dynarl.bus._endpoint import Endpoint
from dynarl.bus._messages import (
    PROTOCOL_VERSION,
    SUPPORTED_PROTOCOLS,
    Ack,
    ChannelGet,
    ChannelItem,
    ChannelPut,
    Heartbeat,
    PeerEvent,
    Register,
    Unregister,
    Welcome,
)
from dynarl.bus._peers import Peer, PeerTable, overdue
from dynarl.bus._transport import RouterLink, open_router
from dynarl.errors import BusError, PeerLostError

__all__ = ["BusServer"]

logger = logging.getLogger(__name__)

_ACK = Ack()


class BusServer(Endpoint, AsyncResource):
    """Request/reply server bound at ``address`` (loopback by default; port 0 = any free).

    Use as ``async with BusServer(...) as server:`` on the loop that will serve it. A
    routable address requires ``curve`` (ValueError otherwise). ``on_peer`` is called on
    the loop with a ``PeerEvent`` whenever a client registers, leaves or is lost.
    """

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:0",
        *,
        name: str = "controller",
        config: BusConfig | None = None,
        curve: CurveServer | None = None,
        on_peer: Callable[[PeerEvent], None] | None = None,
    ) -> None:
        config = config or BusConfig()
        super().__init__(name=name, config=config)
        self._bind_address = address
        self._curve = curve
        self._on_peer = on_peer
        self._peers = PeerTable()
        self._link: RouterLink | None = None
        self.channels = ChannelTable(config.channel_capacity)
        """The channel queues this server hosts (bind local channels to it directly)."""
        self.route(Heartbeat, self._echo)
        self.route(Unregister, self._unregister)
        self.route(ChannelPut, self._channel_put)
        self.route(ChannelGet, self._channel_get)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> BusServer:
        """Bind and start serving. Raises ValueError for an unsafe address, RuntimeError
        if the server was already started."""
        await self._open_resource()
        return self

    async def _open(self, stack: AsyncExitStack) -> None:
        link = self._link = open_router(self._bind_address, self.config, self._curve)
        stack.push_async_callback(self._close_link, link)
        self._send, self._send_direct = link.send, link.send_direct
        self._peer_of = self._peers.get
        await self._start(
            stack, self._receive(link.recv, link.recv_nowait), self._reap(), link.serve()
        )
        stack.push_async_callback(self._stop_serving)
        logger.info("bus server %s listening on %s", self.name, link.address)

    async def _stop_serving(self) -> None:
        """Fail pending requests, cancel handlers and the loops."""
        await self._stop(list(self._peers))

    async def _close_link(self, link: RouterLink) -> None:
        self._link = None
        await link.aclose()
        logger.info("bus server %s closed", self.name)

    async def aclose(self) -> None:
        """Stop serving: fail pending requests, cancel handlers, close the socket
        (idempotent)."""
        await super().aclose()

    # ------------------------------------------------------------------ public

    @property
    def address(self) -> str:
        """The bound address (with the actual port). Raises BusError before ``start``."""
        if self._link is None:
            raise BusError(f"server {self.name!r} is not running")
        address: str = self._link.address
        return address

    def peers(self) -> list[str]:
        """Names of the registered clients, sorted."""
        return self._peers.names()

    def peer(self, name: str) -> Peer | None:
        """The registered client called ``name``, if any."""
        return self._peers.named(name)

    async def request(self, peer: str, message: Any, *, timeout: float | None = None) -> Any:
        """Send ``message`` to client ``peer`` and return its reply.

        Raises DeadlineExceeded after ``timeout`` seconds (default
        ``config.default_timeout_s``; the client's handler is then cancelled),
        PeerLostError if the client is not registered or is lost while waiting,
        RemoteError or ProtocolError if it answers with an error. Cancelling the caller
        cancels the client's handler.
        """
        target = self._peers.named(peer)
        if target is None:
            raise PeerLostError(peer, f"no peer named {peer!r} is registered")
        return await self._request(target, message, timeout)

    def notify(self, peer: str, message: Any) -> bool:
        """Send a one-way message to client ``peer``; False if it could not be sent."""
        target = self._peers.named(peer)
        return target is not None and self._notify(target, message)

    # ------------------------------------------------------------------ receive loop

    def _out(self, key: bytes, data: bytes) -> bool:
        sent: bool = (self._send if self._waiting else self._send_direct)(key, data)
        return sent

    def _handle(self, frames: list[bytes]) -> None:
        self.stats.frames_in += 1
        key = frames[0]
        peer = self._peer_of(key)
        if peer is not None:
            peer.last_seen = self._now()
        if len(frames) != 2:
            count = len(frames) - 1
            self._refuse(peer, key, Refusal("frame_count", f"expected 1 frame, got {count}"))
            return
        frame = self._codec.decode(frames[1])
        if isinstance(frame, Refusal):
            self._refuse(peer, key, frame)
        elif peer is None or isinstance(frame.body, Register):
            self._on_stranger(peer, key, frame)
        else:
            self._on_frame(peer, frame)

    def _on_stranger(self, peer: Peer | None, key: bytes, frame: Frame) -> None:
        rid = frame.request_id
        if isinstance(frame.body, Register) and frame.kind == 1:
            self._register(key, rid, frame.body)
        elif peer is not None:
            self._refuse(peer, key, Refusal("invalid", "Register must be a request", rid))
        else:
            why = f"register first: send a Register request with protocol={PROTOCOL_VERSION}"
            self._refuse(None, key, Refusal("not_registered", why, rid))

    # ------------------------------------------------------------------ registry

    def _register(self, key: bytes, rid: int, message: Register) -> None:
        if message.protocol not in SUPPORTED_PROTOCOLS:
            speaks = ", ".join(str(version) for version in sorted(SUPPORTED_PROTOCOLS))
            why = f"unsupported protocol version {message.protocol}; this server speaks {speaks}"
            self._refuse(None, key, Refusal("protocol_version", why, rid))
            return
        if not message.name or len(message.name) > 200:
            self._refuse(None, key, Refusal("invalid", "peer name must be 1-200 characters", rid))
            return
        peer = Peer(name=message.name, key=key, last_seen=self._now(), info=message)
        displaced = self._peers.add(peer)
        if displaced is not None:
            self._drop(displaced, "lost", f"peer {displaced.name!r} registered again")
        config = self.config
        welcome = Welcome(
            protocol=PROTOCOL_VERSION,
            server=self.name,
            peer=peer.name,
            heartbeat_interval_s=config.heartbeat_interval_s,
            num_missed_heartbeats=config.num_missed_heartbeats,
            max_message_bytes=config.max_message_bytes,
        )
        self._reply_to(key, rid, welcome)
        logger.info("%s: peer %r registered (role %r)", self.name, peer.name, message.role)
        self._emit(peer, "registered")

    def _drop(self, peer: Peer, event: str, why: str, *, reason: str = "") -> None:
        self._peers.remove(peer)
        self._lose(peer, PeerLostError(peer.name, why))
        self._emit(peer, event, reason=reason)

    def _emit(self, peer: Peer, event: str, *, reason: str = "") -> None:
        if self._on_peer is None:
            return
        try:
            event_message = PeerEvent(
                peer=peer.name, event=event, time=time.time(), role=peer.role, reason=reason
            )
            self._on_peer(event_message)
        except Exception:  # a callback's failure must not stop the receive loop
            logger.exception("%s: on_peer callback failed", self.name)

    async def _reap(self) -> None:
        config = self.config
        while True:
            woke = self._now() + config.check_interval_s
            await asyncio.sleep(config.check_interval_s)
            now = self._now()
            if now - woke > config.check_interval_s:
                # This loop itself was stalled: heartbeats may be waiting unread, so let the
                # receive loop catch up before judging anyone's silence.
                continue
            for peer in overdue(self._peers, now, config.loss_after_s):
                silent = now - peer.last_seen
                logger.warning("%s: peer %r lost (silent %.2f s)", self.name, peer.name, silent)
                self.stats.peers_lost += 1
                self._drop(peer, "lost", f"peer {peer.name!r} was lost (silent {silent:.2f} s)")

    # ------------------------------------------------------------------ built-in handlers

    def _echo(self, message: Heartbeat, peer: Peer) -> None:
        self._notify(peer, message)

    def _unregister(self, message: Unregister, peer: Peer) -> None:
        logger.info("%s: peer %r left (%s)", self.name, peer.name, message.reason or "no reason")
        self._drop(peer, "left", f"peer {peer.name!r} left", reason=message.reason)

    async def _channel_put(self, message: ChannelPut, peer: Peer) -> Ack:
        await self.channels.channel_put(
            message.channel, message.key, message.item, capacity=message.capacity, timeout=None
        )
        return _ACK

    async def _channel_get(self, message: ChannelGet, peer: Peer) -> ChannelItem:
        item = await self.channels.channel_get(
            message.channel, message.key, capacity=message.capacity, timeout=None
        )
        return ChannelItem(channel=message.channel, key=message.key, item=item)
