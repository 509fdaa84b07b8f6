"""What every server-backed engine adapter shares: launch a server or attach to one, then
talk to it through a client (``VLLMEngine``, ``SGLangServerEngine``).

A subclass names its engine (``kind``) and says how to make its client for a URL
(:meth:`ServerEngine._open_client`); the life cycle is here once. Runs on the caller's
event loop.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from dynarl.backends._server_process import ManagedServer

__all__ = ["ServerEngine"]

logger = logging.getLogger(__name__)


class _Client(Protocol):
    async def aclose(self) -> None: ...

    async def health(self) -> bool: ...


S = TypeVar("S", bound=ManagedServer)
C = TypeVar("C", bound=_Client)


class ServerEngine(Generic[S, C]):
    """One server: ``server`` launched on :meth:`start` and stopped on :meth:`aclose`, or a
    running one at ``url`` (left running). An async context manager."""

    kind: ClassVar[str]
    """The engine's name in messages (``"vllm"``)."""

    def __init__(self, *, server: S | None, url: str | None) -> None:
        if (server is None) == (url is None):
            raise ValueError(
                f"{type(self).__name__} needs exactly one of server= (launch) or url= (attach)"
            )
        self._server = server
        self._url = url
        self._client: C | None = None
        self.name = f"{self.kind}@{url.removeprefix('http://')}" if url else self.kind
        """For messages and logs (``vllm@127.0.0.1:8000`` once its address is known)."""

    def _open_client(self, url: str) -> C:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    @property
    def server(self) -> S | None:
        """The server this engine launched (None when attached)."""
        return self._server

    @property
    def url(self) -> str | None:
        """The server's root URL (None before :meth:`start` of a launched server)."""
        if self._server is not None:
            return self._server.url if self._client is not None else None
        return self._url

    @property
    def client(self) -> C:
        """The HTTP client (after :meth:`start`)."""
        if self._client is None:
            raise RuntimeError(f"engine {self.name} is not started")
        return self._client

    async def start(self) -> None:
        """Launch the server and wait until it is healthy (BackendError with its log tail if
        it is not), or attach to ``url``; then open the client."""
        url = self._url
        if self._server is not None:
            await self._server.start()
            url = self._server.url
        assert url is not None
        self.name = f"{self.kind}@{url.removeprefix('http://')}"
        self._client = self._open_client(url)
        logger.info("engine %s ready", self.name)

    async def aclose(self) -> None:
        """Close the client and stop a launched server (idempotent)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._server is not None:
            await self._server.aclose()

    @property
    def exit_cause(self) -> str | None:
        """How a server this engine launched ended on its own (``"killed by SIGKILL"``);
        None while it runs, and always for an attached server (its process is not ours to
        watch)."""
        return self._server.exit_cause if self._server is not None else None

    async def health(self) -> bool:
        """Whether the server's health check answers 200."""
        return await self.client.health()
