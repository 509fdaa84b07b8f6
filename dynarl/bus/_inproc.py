"""In-process links with the same interface as the ZeroMQ ones, for tests and one-process jobs.

An address ``mem://<name>`` names a router or publisher in this process. Frames are the
same bytes the ZeroMQ links carry, so everything above the link (codec, request ids,
deadlines, heartbeats) runs unchanged. All ends of one address must live on one event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

from dynarl.bus._bus_config import BusConfig
from dynarl.errors import BusError

__all__ = ["MemDealer", "MemPublisher", "MemRouter", "MemSubscriber"]

_routers: dict[str, MemRouter] = {}
_publishers: dict[str, MemPublisher] = {}
_ids = itertools.count(1)


class Inbox:
    """A bounded FIFO of messages with at most one waiting receiver (one event loop)."""

    def __init__(self, capacity: int) -> None:
        self._items: deque[list[bytes]] = deque()
        self._capacity = capacity
        self._waiter: asyncio.Future[list[bytes]] | None = None

    def put(self, frames: list[bytes]) -> bool:
        """Queue ``frames`` (or hand them to the waiting receiver); False if full."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_result(frames)
            return True
        if len(self._items) >= self._capacity:
            return False
        self._items.append(frames)
        return True

    def get_nowait(self) -> list[bytes] | None:
        """The oldest queued message, or None."""
        return self._items.popleft() if self._items else None

    def get(self) -> asyncio.Future[list[bytes]]:
        """A future of the next message (already finished when one is queued)."""
        future: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        if self._items:
            future.set_result(self._items.popleft())
        else:
            self._waiter = future
        return future


class MemRouter:
    """The binding end of a request/reply link (like a ROUTER socket)."""

    def __init__(self, address: str, config: BusConfig) -> None:
        if address in _routers:
            raise BusError(f"address {address} is already bound")
        self.address = address
        self._inbox = Inbox(config.recv_hwm)
        self._peers: dict[bytes, MemDealer] = {}
        _routers[address] = self

    def attach(self, dealer: MemDealer) -> bytes:
        """Register a connecting dealer; returns its routing id."""
        identity = b"\x00mem" + next(_ids).to_bytes(8, "big")
        self._peers[identity] = dealer
        return identity

    def detach(self, identity: bytes) -> None:
        """Forget a dealer (it closed)."""
        self._peers.pop(identity, None)

    def deliver(self, frames: list[bytes]) -> bool:
        """Queue frames from a dealer; False if the inbox is full."""
        return self._inbox.put(frames)

    def recv(self) -> asyncio.Future[list[bytes]]:
        """The next message: ``[routing id, *frames]``."""
        return self._inbox.get()

    def recv_nowait(self) -> list[bytes] | None:
        """The next message if one is queued, else None."""
        return self._inbox.get_nowait()

    def send(self, peer: bytes, frame: bytes) -> bool:
        """Send one frame to ``peer`` without waiting; False if it is gone or full."""
        dealer = self._peers.get(peer)
        return dealer is not None and dealer.inbox.put([frame])

    send_direct = send

    async def serve(self) -> None:
        """Nothing runs in the background of an in-process link."""

    async def aclose(self) -> None:
        """Unbind the address."""
        if _routers.get(self.address) is self:
            del _routers[self.address]
        self._peers.clear()


class MemDealer:
    """The connecting end of a request/reply link (like a DEALER socket)."""

    def __init__(self, address: str, config: BusConfig) -> None:
        router = _routers.get(address)
        if router is None:
            raise BusError(f"nothing is bound at {address}")
        self.address = address
        self.inbox = Inbox(config.recv_hwm)
        self._router: MemRouter | None = router
        self._identity = router.attach(self)

    def recv(self) -> asyncio.Future[list[bytes]]:
        """The next message: ``[frame]``."""
        return self.inbox.get()

    def recv_nowait(self) -> list[bytes] | None:
        """The next message if one is queued, else None."""
        return self.inbox.get_nowait()

    def send_nowait(self, frame: bytes) -> bool:
        """Send one frame without waiting; False if the router is gone or full."""
        return self.send_frames([frame])

    send_direct = send_nowait

    def send_frames(self, frames: list[bytes]) -> bool:
        """Send a multi-frame message (tests use this to send malformed frame counts)."""
        router = self._router
        if router is None or _routers.get(self.address) is not router:
            return False
        return router.deliver([self._identity, *frames])

    async def serve(self) -> None:
        """Nothing runs in the background of an in-process link."""

    async def aclose(self) -> None:
        """Disconnect: the router can no longer route to this dealer."""
        if self._router is not None:
            self._router.detach(self._identity)
            self._router = None


class MemPublisher:
    """The binding end of a publish/subscribe link (like a PUB socket)."""

    def __init__(self, address: str, config: BusConfig) -> None:
        if address in _publishers:
            raise BusError(f"address {address} is already bound")
        self.address = address
        self._subscribers: list[MemSubscriber] = []
        _publishers[address] = self

    def attach(self, subscriber: MemSubscriber) -> None:
        """Register a subscriber."""
        self._subscribers.append(subscriber)

    def detach(self, subscriber: MemSubscriber) -> None:
        """Forget a subscriber."""
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)

    def send(self, topic: bytes, frame: bytes) -> bool:
        """Deliver to every subscriber whose prefix matches; full subscribers miss it."""
        for subscriber in self._subscribers:
            if subscriber.wants(topic):
                subscriber.inbox.put([topic, frame])
        return True

    async def serve(self) -> None:
        """Nothing runs in the background of an in-process link."""

    async def aclose(self) -> None:
        """Unbind the address."""
        if _publishers.get(self.address) is self:
            del _publishers[self.address]
        self._subscribers.clear()


class MemSubscriber:
    """The connecting end of a publish/subscribe link (like a SUB socket)."""

    def __init__(self, address: str, config: BusConfig) -> None:
        publisher = _publishers.get(address)
        if publisher is None:
            raise BusError(f"nothing is bound at {address}")
        self.inbox = Inbox(config.recv_hwm)
        self._prefixes: list[bytes] = []
        self._publisher: MemPublisher | None = publisher
        publisher.attach(self)

    def subscribe(self, prefix: bytes) -> None:
        """Receive topics starting with ``prefix``."""
        self._prefixes.append(prefix)

    def wants(self, topic: bytes) -> bool:
        """Whether a topic matches a subscribed prefix."""
        return any(topic.startswith(prefix) for prefix in self._prefixes)

    def recv(self) -> asyncio.Future[list[bytes]]:
        """The next message: ``[topic, frame]``."""
        return self.inbox.get()

    async def serve(self) -> None:
        """Nothing runs in the background of an in-process link."""

    async def aclose(self) -> None:
        """Stop receiving."""
        if self._publisher is not None:
            self._publisher.detach(self)
            self._publisher = None
