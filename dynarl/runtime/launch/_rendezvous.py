"""Rendezvous over the job's TCPStore: every rank finds the controller's bus address.

The store is unauthenticated, so it carries public data only: bus addresses and CURVE
*public* keys. Trust never comes from it: the controller's ZAP handler accepts exactly the
public keys of its allow-list (provisioned outside the job), and a worker connects only to
a controller whose public key is on that same list.

Protocol, under ``<prefix>/``:

- a worker takes a ticket ``i = add("requests", 1)`` and writes ``request/<i>``: a
  :class:`JoinRequest` (rank, node, public key, a random nonce);
- the controller's :class:`AdmissionDesk` reads the requests in order and writes
  ``answer/<nonce>``: an :class:`Admission` (its address and public key, its session, or
  a refusal with the reason);
- the worker waits for the answer to *its* nonce.

Answers are keyed by a fresh nonce per process, so keys left in the store by an earlier
attempt (torchrun keeps its store across restarts) are never taken for current ones; a
restarted controller answers old requests too, harmlessly. The session (random per
controller start) names the part of the store the job's groups may use in that attempt.
Blocking store calls: run them in a thread (``asyncio.to_thread``) from a loop.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from dynarl.errors import DeadlineExceeded, WorkerError

__all__ = ["Admission", "AdmissionDesk", "JoinRequest", "Store", "request_admission"]

logger = logging.getLogger(__name__)


class Store(Protocol):
    """What the rendezvous needs of a ``torch.distributed.Store``."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, value: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...


class JoinRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A worker asks to join (written to the store)."""

    rank: int
    """Its global rank."""
    node_rank: int
    """Its node."""
    public_key: str
    """Its node's Z85 CURVE public key, or empty without CURVE."""
    nonce: str
    """Random per process: the key of the answer."""
    host: str
    """Its host name (informational)."""


class Admission(msgspec.Struct, frozen=True, kw_only=True):
    """The controller's answer (written to the store)."""

    accepted: bool
    """Whether the worker may connect."""
    address: str = ""
    """The controller's bus address."""
    server_key: str = ""
    """The controller's Z85 CURVE public key, or empty without CURVE."""
    session: str = ""
    """Random per controller start: names the store space of this attempt."""
    reason: str = ""
    """Why it was refused."""


def request_admission(
    store: Store,
    *,
    prefix: str,
    rank: int,
    node_rank: int,
    public_key: bytes | None,
    trusted: frozenset[bytes] | None,
    timeout_s: float,
    poll_s: float = 0.05,
    stop: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Admission:
    """Ask the controller to admit this rank and wait for its answer (blocking).

    ``trusted`` holds the Z85 public keys a controller may have (None: no CURVE). Raises
    DeadlineExceeded if no answer comes within ``timeout_s``, WorkerError if the controller
    refuses (its reason in the message) or answers with a key that is not trusted, or when
    ``stop()`` turns true while waiting (the caller was cancelled).
    """
    nonce = secrets.token_hex(16)
    request = JoinRequest(
        rank=rank,
        node_rank=node_rank,
        public_key=(public_key or b"").decode(),
        nonce=nonce,
        host=socket.gethostname(),
    )
    index = store.add(f"{prefix}/requests", 1)
    store.set(f"{prefix}/request/{index}", msgspec.json.encode(request).decode())
    key = f"{prefix}/answer/{nonce}"
    deadline = clock() + timeout_s
    while not store.check([key]):
        if stop():
            raise WorkerError(f"rank {rank}: stopped while waiting for the controller")
        if clock() > deadline:
            raise DeadlineExceeded(f"rank {rank}: no controller answered within {timeout_s} s")
        sleep(poll_s)
    admission = msgspec.json.decode(store.get(key), type=Admission)
    if not admission.accepted:
        raise WorkerError(f"rank {rank} was refused by the controller: {admission.reason}")
    if trusted is not None and admission.server_key.encode() not in trusted:
        raise WorkerError(f"rank {rank}: the controller's public key is not on the allow-list")
    logger.info("rank %d admitted by the controller at %s", rank, admission.address)
    return admission


class AdmissionDesk:
    """The controller's side: answers join requests (call :meth:`poll` periodically).

    ``allowed`` is the allow-list of Z85 public keys (None: no CURVE, everyone is
    admitted). A request whose key is not on it is refused with the reason. A ticket
    whose request never appears (its worker died in between) is given up after
    ``grace_s``.
    """

    def __init__(
        self,
        store: Store,
        *,
        prefix: str,
        address: str,
        server_key: bytes | None,
        allowed: frozenset[bytes] | None,
        session: str | None = None,
        grace_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (server_key is None) != (allowed is None):
            raise ValueError("server_key and allowed go together (CURVE) or are both None")
        self.session = session or secrets.token_hex(8)
        """This controller start's session."""
        self._store, self._prefix = store, prefix
        self._address, self._server_key, self._allowed = address, server_key, allowed
        self._grace_s, self._clock = grace_s, clock
        self._next = 1
        self._waiting: dict[int, float] = {}
        self.admitted: dict[int, JoinRequest] = {}
        """The last request admitted per rank."""

    def poll(self) -> list[JoinRequest]:
        """Answer every request written since the last call; returns them (blocking)."""
        count = self._store.add(f"{self._prefix}/requests", 0)
        now = self._clock()
        for index in range(self._next, count + 1):
            self._waiting.setdefault(index, now)
        self._next = max(self._next, count + 1)
        answered = []
        for index, since in sorted(self._waiting.items()):
            key = f"{self._prefix}/request/{index}"
            if self._store.check([key]):
                del self._waiting[index]
                request = msgspec.json.decode(self._store.get(key), type=JoinRequest)
                self._answer(request)
                answered.append(request)
            elif now - since > self._grace_s:
                del self._waiting[index]
                logger.warning("join ticket %d was never written; giving it up", index)
        return answered

    def _answer(self, request: JoinRequest) -> None:
        key = request.public_key.encode()
        if self._allowed is not None and key not in self._allowed:
            reason = f"public key {request.public_key!r} is not on the controller's allow-list"
            logger.warning("refused rank %d (node %d): %s", request.rank, request.node_rank, reason)
            admission = Admission(accepted=False, reason=reason)
        else:
            admission = Admission(
                accepted=True,
                address=self._address,
                server_key=(self._server_key or b"").decode(),
                session=self.session,
            )
            self.admitted[request.rank] = request
            logger.info("admitted rank %d from %s", request.rank, request.host)
        answer = msgspec.json.encode(admission).decode()
        self._store.set(f"{self._prefix}/answer/{request.nonce}", answer)
