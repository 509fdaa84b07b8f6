"""Request/reply machinery shared by the server and the client.

An endpoint correlates replies with requests by id, enforces deadlines on both sides,
propagates cancellation (a ``CANCEL`` frame cancels the remote handler task), fails the
waiters on a lost peer, and refuses bad frames with a counted, rate-limited, addressed
error reply. Everything here runs on the endpoint's event loop.

Handlers are registered per message type with :meth:`Endpoint.route`; a handler's type,
:data:`Handler`, is generic over the message type it is routed (``Handler[Ping]`` takes a
``Ping``), so a type checker matches each handler with its route. A plain function
runs inline in the receive loop (the fast path: no task per request); a coroutine function
runs as a task in the endpoint's task group, under the requester's deadline, and is
cancelled when the requester cancels or is lost.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Final, TypeAlias, TypeVar

from dynarl._resource import Background, background
from dynarl.bus._bus_config import BusConfig
from dynarl.bus._codec import Frame, FrameCodec, Refusal
from dynarl.bus._messages import MESSAGE_TYPES, Ack, ErrorReply, Message, Ping, Pong
from dynarl.bus._peers import Peer
from dynarl.bus._pending import PendingRequests
from dynarl.bus._stats import (
    BAD_FRAME_REASONS,
    BusStats,
    RateLimitedLog,
    error_code,
    error_from_reply,
)
from dynarl.errors import (
    BusError,
    PeerLostError,
    ProtocolError,
)

__all__ = ["Endpoint", "Handler", "Reply"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
"""A message type of the request/reply socket (control or data channel)."""
Reply: TypeAlias = Message | None
"""What a handler answers: a bus message, or None for ``Ack``."""
Handler: TypeAlias = Callable[[M, Peer], Reply | Awaitable[Reply]]
"""``handler(message, peer)`` for messages of type ``M``, returning the reply, or a
coroutine function returning it."""
_AnyHandler: TypeAlias = Callable[[Any, Peer], Any]
"""A routed handler as the receive loop calls it (its message type checked at routing)."""

_MAX_TIMEOUT_MS: Final = 2**32 - 1
_ACK: Final = Ack()
_REQUEST, _REPLY, _NOTIFY, _CANCEL = 1, 2, 3, 4
_BURST: Final = 256


def _pong(message: Ping, peer: Peer) -> Pong:
    return Pong(seq=message.seq, payload=message.payload)


class UnsentError(BusError):
    """A message could not even be queued: no connection to the peer, or its queue full."""


class Endpoint:
    """Base of :class:`~dynarl.bus.BusServer` and :class:`~dynarl.bus.BusClient`."""

    def __init__(self, *, name: str, config: BusConfig) -> None:
        if not name or len(name) > 200:
            raise ValueError(f"endpoint name must be 1-200 characters, got {name!r}")
        self.name = name
        self.config = config
        self.stats = BusStats()
        self._codec = FrameCodec(config.max_message_bytes)
        self._encode = self._codec.encode
        self._log = RateLimitedLog(logger, config.log_interval_s)
        self._handlers: dict[type, tuple[_AnyHandler, bool]] = {}
        self._ids = itertools.count(1)
        self._group: Background | None = None
        self._background: list[asyncio.Task[None]] = []
        self._notified: set[asyncio.Task[None]] = set()
        self._closed = False
        self._waiting = False
        """Whether the receive loop awaits the link: only then must sends use the slow path."""
        self._woke = False
        """Whether the message just handled resumed a waiting request."""
        self.route(Ping, _pong)

    # ------------------------------------------------------------------ public

    def route(self, message_type: type[M], handler: Handler[M]) -> None:
        """Serve requests and notifications of ``message_type`` with ``handler``.

        Raises ValueError if the type is not a bus message of the request/reply socket.
        """
        if message_type not in MESSAGE_TYPES:
            raise ValueError(f"{message_type!r} is not a bus message type")
        is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            type(handler).__call__
        )
        self._handlers[message_type] = (handler, is_async)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has run."""
        return self._closed

    # ------------------------------------------------------------------ subclass hooks

    def _out(self, key: bytes, data: bytes) -> bool:
        """Send a frame to routing id ``key`` without waiting; False if it was dropped."""
        raise NotImplementedError

    def _handle(self, frames: list[bytes]) -> None:
        """Dispatch one received message (receive loop)."""
        raise NotImplementedError

    def _stale_reply(self, peer: Peer, body: Any) -> None:
        """A reply matching no waiting request (given up, or the peer refused a frame)."""
        # A late "deadline_exceeded" or "handler_error" answers a request we gave up on;
        # only refusals of our own frames are worth a warning.
        if isinstance(body, ErrorReply) and body.code in BAD_FRAME_REASONS:
            self._log.warning(
                body.code,
                "%s: %s refused a frame: %s: %s",
                self.name,
                peer.name,
                body.code,
                body.message,
            )

    # ------------------------------------------------------------------ lifecycle

    async def _start(self, stack: AsyncExitStack, *loops: Awaitable[None]) -> None:
        """Start the endpoint's loops in a task group that ``stack`` closes (waiting for
        every task the endpoint started: loops, handlers, notifications)."""
        self._loop = asyncio.get_running_loop()
        self._now = self._loop.time
        self._pending = PendingRequests(self._loop, self._cancel_remote)
        self._waiters = self._pending.waiting
        tasks = await stack.enter_async_context(background())
        self._group = tasks
        self._background = [tasks.create_task(loop) for loop in loops]  # type: ignore[arg-type]

    async def _stop(
        self,
        peers: list[Peer],
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        self._closed = True
        for task in [*self._background, *self._notified]:
            task.cancel()
        for peer in peers:
            for task in peer.running.values():
                task.cancel()
            peer.running.clear()
        self._pending.close(BusError(f"endpoint {self.name!r} closed"))
        # The task group itself closes next on the owner's exit stack and waits for the
        # cancelled tasks; only a crash of the endpoint's own tasks surfaces from there.
        self._group = None

    async def _receive(
        self,
        recv: Callable[[], asyncio.Future[list[bytes]]],
        recv_nowait: Callable[[], list[bytes] | None],
    ) -> None:
        handle = self._handle
        while True:
            self._waiting = True
            future = recv()
            backlog = future.done()
            frames = await future
            self._waiting = False
            self._woke = False
            handle(frames)
            if backlog:  # drain the queue without the cost of an awaited receive per message
                for _ in range(_BURST):
                    queued = recv_nowait()
                    if queued is None:
                        break
                    handle(queued)
            if backlog or self._woke:
                # Let the requests just answered resume (and send their next frames
                # cheaply, see ``_waiting``) before the next receive is armed; this also
                # keeps a flood from starving other tasks (awaiting a ready socket does
                # not yield to them).
                await asyncio.sleep(0)

    # ------------------------------------------------------------------ outgoing

    async def _request(self, peer: Peer, message: Any, timeout: float | None) -> Any:
        if self._closed:
            raise BusError(f"endpoint {self.name!r} is closed")
        if peer.lost:
            raise PeerLostError(peer.name)
        seconds = self.config.default_timeout_s if timeout is None else timeout
        if not seconds > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if self._group is None:
            raise BusError(f"endpoint {self.name!r} is not started")
        rid = next(self._ids)
        data = self._encode(_REQUEST, rid, min(math.ceil(seconds * 1000), _MAX_TIMEOUT_MS), message)
        future = self._loop.create_future()
        self._pending.add(rid, future, peer, seconds)
        try:
            if not self._out(peer.key, data):
                raise UnsentError(f"could not send to {peer.name!r}: unreachable or queue full")
            self.stats.requests_out += 1
            self.stats.frames_out += 1
            return await future
        except asyncio.CancelledError:
            if self._waiters.pop(rid, None) is not None:
                self._cancel_remote(peer, rid)
            raise
        finally:
            self._waiters.pop(rid, None)

    def _cancel_remote(self, peer: Peer, rid: int) -> None:
        if not peer.lost and not self._closed:
            self._out(peer.key, self._encode(_CANCEL, rid, 0, None))

    def _notify(self, peer: Peer, message: Any) -> bool:
        if peer.lost or self._closed:
            return False
        sent = self._out(peer.key, self._encode(_NOTIFY, 0, 0, message))
        if sent:
            self.stats.frames_out += 1
        else:
            self.stats.replies_dropped += 1
        return sent

    def _lose(self, peer: Peer, exc: BusError) -> None:
        """Mark ``peer`` lost: fail the requests waiting on it, cancel its handler tasks."""
        peer.lost = True
        self._pending.fail(peer, exc)
        for task in peer.running.values():
            task.cancel()
        peer.running.clear()

    # ------------------------------------------------------------------ incoming

    def _refuse(self, peer: Peer | None, key: bytes, refusal: Refusal) -> None:
        self.stats.bad_frames[refusal.reason] += 1
        self._log.warning(
            refusal.reason,
            "%s refused a frame from %s: %s: %s",
            self.name,
            peer.name if peer is not None else key.hex(),
            refusal.reason,
            refusal.message,
        )
        reply = ErrorReply(code=refusal.reason, message=refusal.message)
        self._reply_to(key, refusal.request_id, reply)

    def _reply_to(self, key: bytes, rid: int, reply: Any) -> None:
        """Send a reply frame to routing id ``key``."""
        if self._out(key, self._reply_frame(rid, reply)):
            self.stats.frames_out += 1
        else:
            self.stats.replies_dropped += 1

    def _on_frame(self, peer: Peer, frame: Frame) -> None:
        kind = frame.kind
        if kind == _REPLY:
            self._on_reply(peer, frame)
            return
        if kind == _CANCEL:
            task = peer.running.pop(frame.request_id, None)
            if task is not None:
                task.cancel()
                self.stats.cancelled += 1
            return
        body = frame.body
        entry = self._handlers.get(type(body))
        if entry is None:
            reason = "invalid" if body is None else "no_handler"
            what = "a body" if body is None else f"a handler for {type(body).__name__}"
            self._refuse(
                peer, peer.key, Refusal(reason, f"{self.name} has no {what}", frame.request_id)
            )
            return
        handler, is_async = entry
        if kind == _NOTIFY:
            if is_async:
                self._spawn_notified(handler, body, peer)
            else:
                self._call(handler, body, peer)
            return
        rid = frame.request_id
        self.stats.requests_in += 1
        if not is_async:
            self._reply_to(peer.key, rid, self._call(handler, body, peer))
        elif rid in peer.running:
            self._refuse(peer, peer.key, Refusal("invalid", f"request id {rid} is in use", rid))
        else:
            assert self._group is not None
            peer.running[rid] = self._group.create_task(
                self._serve(handler, body, peer, rid, frame.timeout_ms)
            )

    def _on_reply(self, peer: Peer, frame: Frame) -> None:
        rid = frame.request_id
        entry = self._waiters.get(rid)
        body = frame.body
        if entry is None or entry[1] is not peer:
            self.stats.stale_replies += 1
            self._stale_reply(peer, body)
            return
        del self._waiters[rid]
        future = entry[0]
        if future.done():
            return
        self._woke = True
        if isinstance(body, ErrorReply):
            future.set_exception(error_from_reply(body))
        elif body is None:
            future.set_exception(ProtocolError(f"invalid: reply {rid} has no body"))
        else:
            future.set_result(body)

    def _call(self, handler: _AnyHandler, body: Any, peer: Peer) -> Any:
        try:
            return handler(body, peer)
        except Exception as exc:  # a handler's failure is the requester's error reply
            return self._failed(exc, body)

    def _failed(self, exc: Exception, body: Any) -> ErrorReply:
        self.stats.handler_errors += 1
        self._log.warning(
            "handler_error",
            "%s: handler for %s raised %s: %s",
            self.name,
            type(body).__name__,
            type(exc).__name__,
            exc,
        )
        return ErrorReply(code=error_code(exc), message=f"{type(exc).__name__}: {exc}")

    async def _serve(
        self, handler: _AnyHandler, body: Any, peer: Peer, rid: int, timeout_ms: int
    ) -> None:
        scope = asyncio.timeout(timeout_ms / 1000 if timeout_ms else None)
        try:
            async with scope:
                result = await handler(body, peer)
        except TimeoutError as exc:
            if scope.expired():
                result = ErrorReply(
                    code="deadline_exceeded", message=f"no reply within {timeout_ms} ms"
                )
            else:
                result = self._failed(exc, body)
        except asyncio.CancelledError:
            if peer.running.get(rid) is asyncio.current_task():
                del peer.running[rid]
            raise
        except Exception as exc:  # the task's boundary: becomes the error reply
            result = self._failed(exc, body)
        if peer.running.get(rid) is asyncio.current_task():
            del peer.running[rid]
        if not peer.lost:
            self._reply_to(peer.key, rid, result)

    def _spawn_notified(self, handler: _AnyHandler, body: Any, peer: Peer) -> None:
        async def run() -> None:
            try:
                await handler(body, peer)
            except Exception as exc:  # the task's boundary: logged and counted
                self._failed(exc, body)

        self._spawn(run())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the endpoint's task group; it is cancelled when the endpoint closes."""
        if self._group is None:
            work.close()
            return
        task = self._group.create_task(work)
        self._notified.add(task)
        task.add_done_callback(self._notified.discard)

    def _reply_frame(self, rid: int, reply: Any) -> bytes:
        if reply is None:
            reply = _ACK
        elif type(reply) not in MESSAGE_TYPES:
            self.stats.handler_errors += 1
            reply = ErrorReply(
                code="handler_error",
                message=f"handler returned {type(reply).__name__}, not a bus message",
            )
        try:
            return self._encode(_REPLY, rid, 0, reply)
        except ProtocolError as exc:
            return self._encode(_REPLY, rid, 0, ErrorReply(code="oversize", message=str(exc)))
