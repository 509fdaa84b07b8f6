"""Publish/subscribe of events and metrics by topic (PUB/SUB sockets, or in-process).

A message is two frames: the topic (UTF-8) and one ``EventMessage`` (a ledger record,
an aggregated report or a peer event). Subscribers select topics by prefix. Publishing
never blocks: a subscriber that falls more than ``recv_hwm`` messages behind, or that
connects late, misses messages (ZeroMQ's PUB/SUB semantics), so use request/reply for
anything that must arrive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from contextlib import AsyncExitStack

from dynarl._resource import AsyncResource, background
from dynarl.bus._bus_config import BusConfig
from dynarl.bus._codec import MessageCodec, Refusal
from dynarl.bus._curve import CurveClient, CurveServer
from dynarl.bus._messages import EventMessage
from dynarl.bus._stats import BusStats, RateLimitedLog
from dynarl.bus._transport import PubLink, SubLink, open_publisher, open_subscriber
from dynarl.errors import BusError, DeadlineExceeded

__all__ = ["Publisher", "Subscriber"]

logger = logging.getLogger(__name__)


class Publisher(AsyncResource):
    """Publishes events under topics at ``address`` (loopback by default).

    Use as ``async with Publisher(...) as pub:``; a routable address requires ``curve``.
    """

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:0",
        *,
        config: BusConfig | None = None,
        curve: CurveServer | None = None,
    ) -> None:
        self.config = config or BusConfig()
        self.stats = BusStats()
        self._bind_address = address
        self._curve = curve
        self._codec: MessageCodec[EventMessage] = MessageCodec(
            EventMessage, self.config.max_message_bytes
        )
        self._link: PubLink | None = None

    async def _open(self, stack: AsyncExitStack) -> None:
        link = self._link = open_publisher(self._bind_address, self.config, self._curve)
        stack.push_async_callback(self._close_link, link)
        tasks = await stack.enter_async_context(background())
        tasks.create_task(link.serve())

    async def _close_link(self, link: PubLink) -> None:
        self._link = None
        await link.aclose()

    async def aclose(self) -> None:
        """Close the socket; unsent messages are dropped (idempotent)."""
        await super().aclose()

    @property
    def address(self) -> str:
        """The bound address. Raises BusError when not open."""
        if self._link is None:
            raise BusError("publisher is not open")
        return self._link.address

    def publish(self, topic: str, event: EventMessage) -> bool:
        """Publish ``event`` under ``topic``; False if it was dropped.

        Raises ProtocolError if the event exceeds ``max_message_bytes``, BusError if closed.
        """
        if self._link is None:
            raise BusError("publisher is not open")
        sent = self._link.send(topic.encode(), self._codec.encode(event))
        if sent:
            self.stats.frames_out += 1
        else:
            self.stats.replies_dropped += 1
        return sent


class Subscriber(AsyncResource):
    """Receives events whose topic starts with one of ``topics`` (all by default).

    Bad frames are counted in ``stats.bad_frames``, logged (rate-limited) and skipped.
    """

    def __init__(
        self,
        address: str,
        *,
        topics: Iterable[str] = ("",),
        config: BusConfig | None = None,
        curve: CurveClient | None = None,
    ) -> None:
        self.config = config or BusConfig()
        self.stats = BusStats()
        self._address = address
        self._topics = tuple(topics)
        self._curve = curve
        self._codec: MessageCodec[EventMessage] = MessageCodec(
            EventMessage, self.config.max_message_bytes
        )
        self._log = RateLimitedLog(logger, self.config.log_interval_s)
        self._link: SubLink | None = None

    async def _open(self, stack: AsyncExitStack) -> None:
        link = self._link = open_subscriber(self._address, self.config, self._curve)
        stack.push_async_callback(self._close_link, link)
        for topic in self._topics:
            link.subscribe(topic.encode())

    async def _close_link(self, link: SubLink) -> None:
        self._link = None
        await link.aclose()

    async def aclose(self) -> None:
        """Close the socket (idempotent)."""
        await super().aclose()

    async def recv(self, *, timeout: float | None = None) -> tuple[str, EventMessage]:
        """The next well-formed (topic, event).

        Raises DeadlineExceeded if none arrives within ``timeout`` seconds (None: wait
        ``config.default_timeout_s``), BusError if closed.
        """
        if self._link is None:
            raise BusError("subscriber is not open")
        seconds = self.config.default_timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(seconds):
                while True:
                    event = self._decode(await self._link.recv())
                    if event is not None:
                        return event
        except TimeoutError:
            raise DeadlineExceeded(f"no event within {seconds:g} s") from None

    def _decode(self, frames: list[bytes]) -> tuple[str, EventMessage] | None:
        self.stats.frames_in += 1
        if len(frames) != 2:
            self._refuse(Refusal("frame_count", f"expected 2 frames, got {len(frames)}"))
            return None
        topic, data = frames
        try:
            name = topic.decode()
        except UnicodeDecodeError:
            self._refuse(Refusal("malformed", "topic is not UTF-8"))
            return None
        event = self._codec.try_decode(data)
        if isinstance(event, Refusal):
            self._refuse(event)
            return None
        return name, event

    def _refuse(self, refusal: Refusal) -> None:
        self.stats.bad_frames[refusal.reason] += 1
        self._log.warning(
            refusal.reason, "subscriber refused a frame: %s: %s", refusal.reason, refusal.message
        )
