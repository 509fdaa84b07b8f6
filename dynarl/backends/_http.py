"""One HTTP call to an engine server, with a deadline and bounded retries (``aiohttp``).

The engine clients (:mod:`.sglang`, :mod:`.vllm`) share this transport; each decides which
of its endpoints are idempotent. The rule:

- a call that failed to *connect* (the request never reached the server) is retried,
  whatever the endpoint;
- a call whose connection broke, that timed out, or that got 502/503/504 is retried only
  if the endpoint is idempotent;
- any other status outside ``ok`` raises at once.

Failures raise :class:`~dynarl.errors.BackendError` naming the engine, method and path.
:class:`HttpClientConfig` and :class:`HttpClient` are what every engine client shares: how
it reaches its server (address, key, deadlines, retries) and its connection pool. Runs on
the caller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, Self

import aiohttp
import msgspec

from dynarl.errors import BackendError

__all__ = [
    "KEEPALIVE_S",
    "HttpClient",
    "HttpClientConfig",
    "Method",
    "Reply",
    "RetryPolicy",
    "call",
    "decode_reply",
]

logger = logging.getLogger(__name__)

Method = Literal["GET", "POST"]

_RETRY_STATUSES = frozenset({502, 503, 504})
KEEPALIVE_S = 3.0
"""Seconds an idle pooled connection is kept: less than the servers' own keep-alive (uvicorn,
under vLLM and SGLang: 5 s), so a request never goes out on a connection the server is
closing — a generation sent on one fails with ``Connection reset by peer`` and, not
idempotent, is not retried here (seen in the vLLM demo, on an engine idle for a while)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How often and how patiently a call is retried."""

    num_attempts: int
    """Attempts per call, counting the first."""
    backoff_s: float
    """First retry delay; doubles per attempt."""
    max_backoff_s: float
    """Cap on the retry delay."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply's status and raw body."""

    status: int
    body: bytes


async def call(
    session: aiohttp.ClientSession,
    method: Method,
    path: str,
    *,
    engine: str,
    policy: RetryPolicy,
    deadline: aiohttp.ClientTimeout,
    body: object | None = None,
    params: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
    idempotent: bool = False,
    ok: Sequence[int] = (200,),
) -> Reply:
    """One request (``body`` JSON-encoded), each attempt within ``deadline``, with retries;
    raises BackendError unless the status is in ``ok``."""
    data = msgspec.json.encode(body) if body is not None else None
    sent = dict(headers or {})
    if data is not None:
        sent["Content-Type"] = "application/json"
    where = f"{engine} {method} {path}"
    delay = policy.backoff_s
    for attempt in range(1, policy.num_attempts + 1):
        last = attempt == policy.num_attempts
        try:
            async with session.request(
                method, path.lstrip("/"), data=data, params=params, headers=sent, timeout=deadline
            ) as response:
                reply = Reply(response.status, await response.read())
        except aiohttp.ClientConnectorError as exc:
            if last:
                raise BackendError(f"{where}: cannot connect: {exc}") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            if last or not idempotent:
                raise BackendError(f"{where} failed: {exc!r}") from exc
        else:
            if reply.status in ok:
                return reply
            if last or not idempotent or reply.status not in _RETRY_STATUSES:
                text = reply.body.decode(errors="replace")[:500]
                raise BackendError(f"{where} -> HTTP {reply.status}: {text}")
        logger.debug("retrying %s (attempt %d)", where, attempt + 1)
        await asyncio.sleep(delay)
        delay = min(delay * 2, policy.max_backoff_s)
    raise AssertionError("unreachable: the last attempt returns or raises")


def decode_reply(reply: Reply, kind: type[Any], what: str) -> Any:
    """``reply``'s JSON body as ``kind``; raises BackendError naming ``what`` if it is not."""
    try:
        return msgspec.json.decode(reply.body, type=kind)
    except msgspec.DecodeError as exc:
        raise BackendError(f"{what}: unreadable reply {reply.body[:200]!r}: {exc}") from exc


@dataclass(frozen=True, kw_only=True, slots=True)
class HttpClientConfig:
    """How an engine client reaches its server (each engine's config adds its own keys)."""

    base_url: str
    """Server root, e.g. ``http://127.0.0.1:8000``."""
    api_key: str | None = None
    """The server's ``--api-key``, sent as a bearer token."""
    connect_timeout_s: float = 5.0
    """Deadline for opening a connection."""
    timeout_s: float = 30.0
    """Deadline for a control call."""
    generate_timeout_s: float = 3600.0
    """Deadline for one generation (a long rollout can take many minutes)."""
    num_attempts: int = 3
    """Attempts per call, counting the first (see the module docstring for which retry)."""
    backoff_s: float = 0.05
    """First retry delay; doubles per attempt."""
    max_backoff_s: float = 1.0
    """Cap on the retry delay."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("timeout_s") and not value > 0:
                raise ValueError(f"{name}.{field.name} must be > 0, got {value}")
        if self.num_attempts < 1:
            raise ValueError(f"{name}.num_attempts must be >= 1, got {self.num_attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"{name} needs 0 <= backoff_s <= max_backoff_s")


class HttpClient:
    """An engine client's connection pool and its one way to call the server; an async
    context manager (``aclose()`` on exit). Constructing it does no I/O."""

    engine: ClassVar[str]
    """The engine's name in errors (``"vLLM"``)."""

    def __init__(self, config: HttpClientConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                base_url=self.config.base_url.rstrip("/") + "/",
                connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S),
            )
        return self._session

    def _headers(self, admin: bool) -> dict[str, str]:
        """The bearer token of a call (``admin``: an admin endpoint, where an engine has
        a key of its own for those)."""
        key = self.config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _call(
        self,
        method: Method,
        path: str,
        *,
        body: object | None = None,
        params: Mapping[str, str] | None = None,
        admin: bool = False,
        idempotent: bool = False,
        timeout_s: float | None = None,
        ok: Sequence[int] = (200,),
    ) -> Reply:
        """One request with retries; raises BackendError unless the status is in ``ok``."""
        config = self.config
        return await call(
            self._http(),
            method,
            path,
            engine=self.engine,
            policy=RetryPolicy(
                num_attempts=config.num_attempts,
                backoff_s=config.backoff_s,
                max_backoff_s=config.max_backoff_s,
            ),
            deadline=aiohttp.ClientTimeout(
                total=timeout_s or config.timeout_s, connect=config.connect_timeout_s
            ),
            body=body,
            params=params,
            headers=self._headers(admin),
            idempotent=idempotent,
            ok=ok,
        )
