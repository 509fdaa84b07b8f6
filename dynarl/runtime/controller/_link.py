"""WorkerLink: how the controller's pieces ask workers for something, over the bus.

Workers register with the controller's bus server as ``worker/<device>``; the link sends
them runtime requests in an ``Envelope`` and serving requests as they are, each with an
explicit deadline, and decodes the replies. Group managers and the coordinator share one
link, and with it the job's :class:`~dynarl.runtime.controller._losses.Losses`: a request to
a worker known to be dead fails at once. Runs on the controller's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import TypeVar

from dynarl.bus import BusServer, GenerationRequest, Sample
from dynarl.errors import ProtocolError
from dynarl.runtime._worker_protocol import RuntimeMessage, pack, unpack
from dynarl.runtime.controller._losses import Losses

__all__ = ["WorkerLink", "worker_name"]

R = TypeVar("R")


def worker_name(device: int) -> str:
    """The bus peer name of ``device``'s worker."""
    return f"worker/{device}"


class WorkerLink:
    """Requests from the controller to its workers (see the module docstring)."""

    def __init__(self, server: BusServer, *, timeout_s: float) -> None:
        """``timeout_s``: the deadline of a request that names none."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.server = server
        self.timeout_s = timeout_s
        self.losses = Losses()
        """The workers known to be dead, and the job's fatal error."""

    def registered(self) -> set[int]:
        """Devices whose worker is registered now (and not known to be dead)."""
        out = set()
        for name in self.server.peers():
            prefix, _, device = name.partition("/")
            if prefix == "worker" and device.isdigit() and not self.losses.is_lost(int(device)):
                out.add(int(device))
        return out

    async def ask(
        self,
        device: int,
        message: RuntimeMessage,
        reply: type[R],
        *,
        deadline_s: float | None = None,
    ) -> R:
        """Send ``message`` to ``device``'s worker and return its reply of type ``reply``.

        Raises PeerLostError, DeadlineExceeded or RemoteError as ``BusServer.request``
        does (PeerLostError at once for a worker known to be dead), ProtocolError if the
        reply has another type.
        """
        timeout = deadline_s or self.timeout_s
        request = self.server.request(worker_name(device), pack(message), timeout=timeout)
        answer = unpack(await self.losses.unless_lost(device, request))
        if not isinstance(answer, reply):
            raise ProtocolError(
                f"invalid: worker {device} answered {type(message).__name__} with "
                f"{type(answer).__name__}, expected {reply.__name__}"
            )
        return answer

    async def ask_all(
        self,
        devices: Iterable[int],
        message: RuntimeMessage,
        reply: type[R],
        *,
        deadline_s: float | None = None,
    ) -> list[R]:
        """:meth:`ask` every device concurrently; results in ``devices`` order.

        Raises the first failure (the other requests still complete or time out).
        """
        tasks = [self.ask(d, message, reply, deadline_s=deadline_s) for d in devices]
        results: Sequence[R | BaseException] = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)  # type: ignore[arg-type]

    async def serve(
        self, device: int, item: GenerationRequest | Sample, *, deadline_s: float
    ) -> Sample:
        """Have ``device``'s active role serve ``item``; its (possibly partial) result.

        Raises as :meth:`ask` does.
        """
        request = self.server.request(worker_name(device), item, timeout=deadline_s)
        answer = await self.losses.unless_lost(device, request)
        if not isinstance(answer, Sample):
            raise ProtocolError(
                f"invalid: worker {device} answered a served item with {type(answer).__name__}"
            )
        return answer
