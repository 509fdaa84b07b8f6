"""One HTTP call to an engine server, with a deadline and bounded retries (``aiohttp``).

The engine clients (:mod:`.sglang`, :mod:`.vllm`) share this transport; each decides which
of its endpoints are idempotent. The rule:

- a call that failed to *connect* (the request never reached the server) is retried,
  whatever the endpoint;
- a call whose connection broke, that timed out, or that got 502/503/504 is retried only
  if the endpoint is idempotent;
- any other status outside ``ok`` raises at once.

Failures raise :class:`~dynarl.errors.BackendError` naming the engine, method and path.
Runs on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import msgspec

from dynarl.errors import BackendError

__all__ = ["Method", "Reply", "RetryPolicy", "call", "decode_reply"]

logger = logging.getLogger(__name__)

Method = Literal["GET", "POST"]

_RETRY_STATUSES = frozenset({502, 503, 504})


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
