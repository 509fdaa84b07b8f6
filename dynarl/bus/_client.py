"""``BusClient``: the connecting end of request/reply (a DEALER socket).

Workers and group managers run one per server they talk to. Entering it connects,
registers (``Register`` → ``Welcome``, adopting the server's heartbeat settings), and
starts heartbeats; if the server stays silent for ``num_missed_heartbeats`` intervals it is
declared lost and every waiting request fails with ``PeerLostError``. A client also serves
requests the server sends it (an ``Interrupt``, a migration phase) with the handlers given
to :meth:`~dynarl.bus._endpoint.Endpoint.route`, and is a channel backend.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

from dynarl._resource import AsyncResource
from dynarl.bus._bus_config import BusConfig
from dynarl.bus._codec import Refusal
from dynarl.bus._curve import CurveClient
from dynarl.bus._endpoint import Endpoint, UnsentError
from dynarl.bus._messages import (
    PROTOCOL_VERSION,
    Ack,
    ChannelGet,
    ChannelItem,
    ChannelPut,
    DataItem,
    ErrorReply,
    Heartbeat,
    Register,
    Unregister,
    Welcome,
)
from dynarl.bus._peers import Peer
from dynarl.bus._transport import DealerLink, open_dealer
from dynarl.errors import DeadlineExceeded, PeerLostError, ProtocolError

__all__ = ["BusClient"]

logger = logging.getLogger(__name__)

_REGISTER_RETRY_S = 0.05
"""Pause between attempts to queue ``Register`` while the link has no connection."""


def _ignore(message: Heartbeat, peer: Peer) -> None:
    """Heartbeat echoes only refresh the server's last-seen time."""


class BusClient(Endpoint, AsyncResource):
    """Request/reply client of the server at ``address``, registered as ``name``.

    Use as ``async with BusClient(address, name=...) as client:`` on one event loop.
    Entering raises ProtocolError if the server refuses the protocol version,
    DeadlineExceeded if it does not answer within ``config.register_timeout_s``.
    ``on_lost`` is called on the loop once, if the server is declared lost.
    """

    def __init__(
        self,
        address: str,
        *,
        name: str,
        config: BusConfig | None = None,
        curve: CurveClient | None = None,
        role: str = "",
        component: str = "",
        worker: int = -1,
        devices: tuple[int, ...] = (),
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name=name, config=config or BusConfig())
        if len(name.encode()) > 255:
            raise ValueError(f"client name must encode to at most 255 bytes, got {name!r}")
        self._address = address
        self._curve = curve
        self._on_lost = on_lost
        self._hello = Register(
            protocol=PROTOCOL_VERSION,
            name=name,
            role=role,
            component=component,
            worker=worker,
            pid=os.getpid(),
            host=socket.gethostname(),
            devices=devices,
        )
        self._server = Peer(name=address, key=b"", last_seen=0.0)
        self._link: DealerLink | None = None
        self.welcome: Welcome | None = None
        """The server's answer to registration (None before)."""
        self.leave_reason = ""
        """Why this client leaves, sent in its ``Unregister`` ("closed" when empty)."""
        self.route(Heartbeat, _ignore)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> BusClient:
        """Connect, register and start heartbeats (see the class docstring for errors;
        RuntimeError if the client was already started)."""
        await self._open_resource()
        return self

    async def _open(self, stack: AsyncExitStack) -> None:
        link = self._link = open_dealer(
            self._address, self.config, self._curve, identity=self.name.encode()
        )
        stack.push_async_callback(self._close_link, link)
        self._send_nowait = link.send_nowait
        self._send_direct = link.send_direct
        await self._start(stack, self._receive(link.recv, link.recv_nowait), link.serve())
        stack.push_async_callback(self._leave)
        self._server.last_seen = self._now()
        reply = await self._register()
        if not isinstance(reply, Welcome) or reply.protocol != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol_version: server answered Register with {reply!r}")
        self.welcome = reply
        self._server.name = reply.server
        # Refuse locally what the server would refuse (its limit may be lower than ours).
        limit = min(self._codec.max_message_bytes, reply.max_message_bytes)
        self._codec.max_message_bytes = limit
        assert self._group is not None
        self._background.append(self._group.create_task(self._heartbeat(reply)))
        logger.info("bus client %s registered with %s at %s", self.name, reply.server, link.address)

    async def _register(self) -> Any:
        """Send ``Register`` until the server answers or ``register_timeout_s`` passes.

        A server that refuses the connection at the handshake (CURVE on, and this client's
        key not allowed or no CURVE at all) leaves ZeroMQ without a pipe to queue on until
        it reconnects: that is the same refusal as a Register never answered, so it keeps
        trying to the deadline and ends in DeadlineExceeded either way.
        """
        timeout = self.config.register_timeout_s
        deadline = self._now() + timeout
        while (remaining := deadline - self._now()) > 0:
            try:
                return await self._request(self._server, self._hello, remaining)
            except UnsentError:
                await asyncio.sleep(min(_REGISTER_RETRY_S, remaining))
        raise DeadlineExceeded(
            f"bus client {self.name!r}: {self._address} did not answer Register in {timeout} s"
        )

    async def _leave(self) -> None:
        """Say ``Unregister`` (once registered), fail pending requests, cancel handlers."""
        if self.welcome is not None:
            self._notify(self._server, Unregister(reason=self.leave_reason or "closed"))
        await self._stop([self._server])

    async def _close_link(self, link: DealerLink) -> None:
        self._link = None
        await link.aclose()
        logger.debug("bus client %s closed", self.name)

    async def aclose(self) -> None:
        """Leave (``Unregister``), fail pending requests, cancel handlers, close the socket
        (idempotent)."""
        await super().aclose()

    # ------------------------------------------------------------------ public

    @property
    def lost(self) -> bool:
        """Whether the server was declared lost (every request now fails at once)."""
        return self._server.lost

    @property
    def server_name(self) -> str:
        """The server's name (its address until registration)."""
        return self._server.name

    async def request(self, message: Any, *, timeout: float | None = None) -> Any:
        """Send ``message`` to the server and return its reply.

        Raises DeadlineExceeded after ``timeout`` seconds (default
        ``config.default_timeout_s``; the server's handler is then cancelled),
        PeerLostError if the server is or becomes lost, RemoteError or ProtocolError if
        it answers with an error, ProtocolError if ``message`` is too large. Cancelling
        the caller cancels the server's handler.
        """
        return await self._request(self._server, message, timeout)

    def notify(self, message: Any) -> bool:
        """Send a one-way message; False if it could not be queued."""
        return self._notify(self._server, message)

    async def channel_put(
        self, channel: str, key: str, item: DataItem, *, capacity: int, timeout: float | None
    ) -> None:
        """Channel backend: append ``item`` to the server-hosted queue (see ``Channel.put``)."""
        put = ChannelPut(channel=channel, key=key, item=item, capacity=capacity)
        reply = await self.request(put, timeout=timeout)
        if not isinstance(reply, Ack):
            raise ProtocolError(f"invalid: ChannelPut answered with {type(reply).__name__}")

    async def channel_get(
        self, channel: str, key: str, *, capacity: int, timeout: float | None
    ) -> DataItem:
        """Channel backend: take from the server-hosted queue (see ``Channel.get``)."""
        reply = await self.request(
            ChannelGet(channel=channel, key=key, capacity=capacity), timeout=timeout
        )
        if not isinstance(reply, ChannelItem):
            raise ProtocolError(f"invalid: ChannelGet answered with {type(reply).__name__}")
        return reply.item

    # ------------------------------------------------------------------ transport hooks

    def _out(self, key: bytes, data: bytes) -> bool:
        sent: bool = (self._send_nowait if self._waiting else self._send_direct)(data)
        return sent

    def _handle(self, frames: list[bytes]) -> None:
        self.stats.frames_in += 1
        server = self._server
        server.last_seen = self._now()
        if len(frames) != 1:
            count = len(frames)
            self._refuse(server, b"", Refusal("frame_count", f"expected 1 frame, got {count}"))
            return
        frame = self._codec.decode(frames[0])
        if isinstance(frame, Refusal):
            self._refuse(server, b"", frame)
        else:
            self._on_frame(server, frame)

    def _stale_reply(self, peer: Peer, body: Any) -> None:
        if isinstance(body, ChannelItem):
            self._return_item(body)
        elif isinstance(body, ErrorReply) and body.code == "not_registered" and self.welcome:
            self._lose_server(f"server {peer.name!r} no longer knows this client")
        else:
            super()._stale_reply(peer, body)

    def _return_item(self, reply: ChannelItem) -> None:
        """A channel item arrived after its ``get`` gave up: put it back, lose nothing."""

        async def put_back() -> None:
            try:
                await self.channel_put(
                    reply.channel, reply.key, reply.item, capacity=1, timeout=None
                )
            except Exception:  # the task's boundary: the item is lost, say which
                logger.exception(
                    "%s: could not return an item of channel %r", self.name, reply.channel
                )

        if not self.lost:
            logger.info("%s: returning an item of channel %r", self.name, reply.channel)
            self._spawn(put_back())

    def _lose_server(self, why: str) -> None:
        if self._server.lost:
            return
        logger.warning("%s: %s", self.name, why)
        self.stats.peers_lost += 1
        self._lose(self._server, PeerLostError(self._server.name, why))
        if self._on_lost is not None:
            self._on_lost()

    async def _heartbeat(self, welcome: Welcome) -> None:
        interval = welcome.heartbeat_interval_s
        loss_after = interval * welcome.num_missed_heartbeats
        period = interval / 4
        seq = 0
        while not self._server.lost:
            self._notify(self._server, Heartbeat(seq=seq, time=self._now()))
            seq += 1
            for _ in range(4):
                woke = self._now() + period
                await asyncio.sleep(period)
                if self._now() - woke > period:
                    # This loop itself was stalled: the server's echoes may be waiting unread,
                    # so let the receive loop catch up before judging the server's silence.
                    break
                silent = self._now() - self._server.last_seen
                if silent > loss_after:
                    self._lose_server(f"server {self._server.name!r} silent for {silent:.2f} s")
                    return
