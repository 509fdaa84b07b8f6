"""``Channel``: keyed, bounded queues between components, with backpressure.

A channel is declared by name (``Channel("samples", Sample)``); components call
``await channel.put(item, key=...)`` and ``await channel.get(key=...)``. Each key is its
own FIFO queue with a bound: ``put`` waits while the queue is full, which slows the
producer to the consumer's pace. The graph extractor reads these calls as the pipeline's
edges; the runtime binds each channel to a backend:

- :class:`ChannelTable`, queues in this process (what the bus server hosts, and what
  tests and one-process jobs use directly);
- :class:`~dynarl.bus.BusClient`, the same queues hosted by the bus server: a blocked
  ``put``'s reply is deferred until there is room.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Generic, Protocol, TypeVar, get_args

from dynarl.bus._messages import DataItem, GenerationRequest, Sample
from dynarl.errors import BusError, DeadlineExceeded, ProtocolError

__all__ = ["Channel", "ChannelBackend", "ChannelTable"]

logger = logging.getLogger(__name__)

T = TypeVar("T", Sample, GenerationRequest)

_ITEM_TYPES = get_args(DataItem)


class ChannelBackend(Protocol):
    """Where channel queues live (``ChannelTable`` here, or a bus server via ``BusClient``)."""

    async def channel_put(
        self, channel: str, key: str, item: DataItem, *, capacity: int, timeout: float | None
    ) -> None:
        """Append ``item``, waiting while the queue is full.

        Raises DeadlineExceeded if ``timeout`` seconds pass first (the item is not added).
        """
        ...

    async def channel_get(
        self, channel: str, key: str, *, capacity: int, timeout: float | None
    ) -> DataItem:
        """Take the oldest item, waiting while the queue is empty.

        Raises DeadlineExceeded if ``timeout`` seconds pass first (nothing is taken).
        """
        ...


class ChannelTable:
    """Bounded FIFO queues by ``(channel, key)``, all on one event loop.

    A queue is created by the first ``put`` or ``get`` that names it, with that call's
    capacity; later calls keep it.
    """

    def __init__(self, default_capacity: int = 64) -> None:
        if default_capacity < 1:
            raise ValueError(f"default_capacity must be >= 1, got {default_capacity}")
        self.default_capacity = default_capacity
        self._queues: dict[tuple[str, str], asyncio.Queue[DataItem]] = {}

    def _queue(self, channel: str, key: str, capacity: int) -> asyncio.Queue[DataItem]:
        queue = self._queues.get((channel, key))
        if queue is None:
            if capacity < 1:
                raise ValueError(f"channel capacity must be >= 1, got {capacity}")
            queue = self._queues[(channel, key)] = asyncio.Queue(capacity)
        return queue

    async def channel_put(
        self, channel: str, key: str, item: DataItem, *, capacity: int, timeout: float | None
    ) -> None:
        """Append ``item`` to ``(channel, key)``, waiting while it is full.

        Raises DeadlineExceeded after ``timeout`` seconds (the item is then not added),
        TypeError if ``item`` is not a channel item.
        """
        if not isinstance(item, _ITEM_TYPES):
            raise TypeError(f"a channel carries Sample or GenerationRequest, not {type(item)!r}")
        queue = self._queue(channel, key, capacity)
        try:
            async with asyncio.timeout(timeout):
                await queue.put(item)
        except TimeoutError:
            raise DeadlineExceeded(
                f"channel {channel!r} key {key!r} stayed full for {timeout:g} s"
            ) from None

    async def channel_get(
        self, channel: str, key: str, *, capacity: int, timeout: float | None
    ) -> DataItem:
        """Take the oldest item of ``(channel, key)``, waiting while it is empty.

        Raises DeadlineExceeded after ``timeout`` seconds (nothing is then taken).
        """
        queue = self._queue(channel, key, capacity)
        try:
            async with asyncio.timeout(timeout):
                return await queue.get()
        except TimeoutError:
            raise DeadlineExceeded(
                f"channel {channel!r} key {key!r} stayed empty for {timeout:g} s"
            ) from None

    def sizes(self) -> dict[tuple[str, str], int]:
        """Items queued now, by ``(channel, key)``."""
        return {name: queue.qsize() for name, queue in self._queues.items()}


class Channel(Generic[T]):
    """A named, keyed, bounded channel of ``Sample`` or ``GenerationRequest`` items.

    Declare it anywhere (module level or as a class attribute of a ``WorkerGroup``); the
    runtime binds it to a backend with :meth:`bind`, which returns a bound copy.
    """

    def __init__(
        self,
        name: str,
        item_type: type[T],
        *,
        capacity: int = 64,
        backend: ChannelBackend | None = None,
    ) -> None:
        if not name:
            raise ValueError("a channel needs a name")
        if item_type not in _ITEM_TYPES:
            raise TypeError(f"a channel carries Sample or GenerationRequest, not {item_type!r}")
        if capacity < 1:
            raise ValueError(f"channel capacity must be >= 1, got {capacity}")
        self.name = name
        self.item_type: type[T] = item_type
        self.capacity = capacity
        self.backend = backend

    def __repr__(self) -> str:
        bound = "bound" if self.backend is not None else "unbound"
        return f"Channel({self.name!r}, {self.item_type.__name__}, {bound})"

    def bind(self, backend: ChannelBackend) -> Channel[T]:
        """A copy of this channel whose operations go to ``backend``."""
        return Channel(self.name, self.item_type, capacity=self.capacity, backend=backend)

    def _backend(self) -> ChannelBackend:
        if self.backend is None:
            raise BusError(f"channel {self.name!r} is not bound; call bind(backend) first")
        return self.backend

    async def put(self, item: T, *, key: str = "", timeout: float | None = None) -> None:
        """Append ``item`` to queue ``key``, waiting while it is full (backpressure).

        Raises TypeError for an item of the wrong type, DeadlineExceeded if the queue
        stays full for ``timeout`` seconds (None: the backend's default), BusError if
        the channel is unbound or the bus fails.
        """
        if not isinstance(item, self.item_type):
            raise TypeError(
                f"channel {self.name!r} carries {self.item_type.__name__}, not {type(item)!r}"
            )
        await self._backend().channel_put(
            self.name, key, item, capacity=self.capacity, timeout=timeout
        )

    async def get(self, *, key: str = "", timeout: float | None = None) -> T:
        """Take the oldest item of queue ``key``, waiting while it is empty.

        Raises DeadlineExceeded if it stays empty for ``timeout`` seconds, ProtocolError
        if the backend returns an item of another type, BusError if unbound.
        """
        item = await self._backend().channel_get(
            self.name, key, capacity=self.capacity, timeout=timeout
        )
        if isinstance(item, self.item_type):
            return item
        raise ProtocolError(
            f"invalid: channel {self.name!r} delivered {type(item).__name__}, "
            f"expected {self.item_type.__name__}"
        )
