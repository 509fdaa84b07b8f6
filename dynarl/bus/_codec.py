"""Encoding and decoding of bus frames, with a precise reason for every refusal.

A request/reply frame is one MessagePack array ``[kind, request_id, timeout_ms, body]``
(``docs/wire.md``). A :class:`FrameCodec` holds one encoder and one typed decoder, built
once per socket; the happy path decodes a frame with a single ``msgspec`` call, and only a
frame that fails is decoded again step by step to say exactly what was wrong.

Decoding enforces what a valid message is, as the message types declare it
(``dynarl.bus._messages``): a message that breaks a rule is refused as ``invalid``, and the
refusal names the field (``$.max_new_tokens``, ``token_ids``); a handler never sees it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any, Final, Generic, TypeVar

import msgspec

from dynarl.bus._messages import Message
from dynarl.errors import ProtocolError

__all__ = ["Frame", "FrameCodec", "Kind", "MessageCodec", "Refusal"]

T = TypeVar("T")

_U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]


class Kind(enum.IntEnum):
    """What a request/reply frame is (its first array element)."""

    REQUEST = 1
    """Expects exactly one ``REPLY`` with the same request id."""
    REPLY = 2
    """Answers the ``REQUEST`` with the same request id."""
    NOTIFY = 3
    """One-way message; never answered (request id 0)."""
    CANCEL = 4
    """The sender gave up on its ``REQUEST`` with this id; the receiver stops working on it."""


_KIND_VALUES: Final = frozenset(int(kind) for kind in Kind)


class Frame(msgspec.Struct, array_like=True, frozen=True):
    """A decoded request/reply frame."""

    kind: Annotated[int, msgspec.Meta(ge=1, le=4)]
    """A :class:`Kind` value."""
    request_id: _U63
    """Correlates a ``REPLY`` or ``CANCEL`` with its ``REQUEST``; 0 for ``NOTIFY``."""
    timeout_ms: _U32
    """Milliseconds the requester will wait (``REQUEST`` only); 0 = no deadline."""
    body: Message | None
    """The message (``None`` for ``CANCEL``)."""


class _RawFrame(msgspec.Struct, array_like=True, frozen=True):
    kind: int
    request_id: _U63
    timeout_ms: _U32
    body: msgspec.Raw


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a frame was refused; ``reason`` is also the error reply's ``code``."""

    reason: str
    """One of ``dynarl.bus._stats.BAD_FRAME_REASONS``."""
    message: str
    """What was wrong, for humans."""
    request_id: int = 0
    """The frame's request id when it could be read, else 0."""

    def error(self) -> ProtocolError:
        """The refusal as an exception."""
        return ProtocolError(f"{self.reason}: {self.message}")


def _tag_of(raw: bytes | msgspec.Raw) -> object:
    try:
        value = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    return value.get("type") if isinstance(value, dict) else None


def _known_tags(union: Any) -> frozenset[str]:
    members = getattr(union, "__args__", (union,))
    return frozenset(
        str(member.__struct_config__.tag)
        for member in members
        if isinstance(member, type) and issubclass(member, msgspec.Struct)
    )


def _classify(exc: Exception, raw: bytes | msgspec.Raw, tags: frozenset[str]) -> tuple[str, str]:
    """(reason, message) for a body that failed to decode as the union."""
    if isinstance(exc, msgspec.ValidationError):
        tag = _tag_of(raw)
        if isinstance(tag, str) and tag not in tags:
            return "unknown_tag", f"unknown message type {tag!r}"
        if tag is not None and not isinstance(tag, str):
            return "unknown_tag", f"message type must be a string, got {tag!r}"
        return "invalid", f"invalid {tag or 'message'}: {exc}"
    return "malformed", f"body is not MessagePack: {exc}"


class FrameCodec:
    """Encoder and typed decoder of request/reply frames for one socket.

    Runs on the socket's event loop; holds no state between calls besides the reused
    ``msgspec`` encoder and decoders.
    """

    def __init__(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(Frame).decode
        self._raw = msgspec.msgpack.Decoder(_RawFrame)
        self._body = msgspec.msgpack.Decoder(Message)
        self._tags = _known_tags(Message)

    def encode(self, kind: int, request_id: int, timeout_ms: int, body: object) -> bytes:
        """One frame. Raises ProtocolError if it exceeds ``max_message_bytes``."""
        data = self._encode((kind, request_id, timeout_ms, body))
        if len(data) > self.max_message_bytes:
            raise ProtocolError(
                f"oversize: a {type(body).__name__} frame of {len(data)} bytes exceeds "
                f"max_message_bytes={self.max_message_bytes}"
            )
        return data

    def decode(self, data: bytes) -> Frame | Refusal:
        """The frame, or the reason it is refused (never raises)."""
        if len(data) > self.max_message_bytes:
            return Refusal(
                "oversize",
                f"frame of {len(data)} bytes exceeds max_message_bytes={self.max_message_bytes}",
            )
        try:
            return self._decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._explain(data)

    def _explain(self, data: bytes) -> Refusal:
        try:
            raw = self._raw.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Refusal(
                "malformed",
                f"a frame must be a MessagePack array [kind, request_id, timeout_ms, body]: {exc}",
            )
        rid = raw.request_id
        if raw.kind not in _KIND_VALUES:
            return Refusal("unknown_kind", f"unknown frame kind {raw.kind} (expected 1-4)", rid)
        try:
            self._body.decode(raw.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reason, message = _classify(exc, raw.body, self._tags)
            return Refusal(reason, message, rid)
        raise AssertionError("frame decoded step by step but not at once")  # pragma: no cover


class MessageCodec(Generic[T]):
    """Encoder and typed decoder of bare messages of one union (publish/subscribe, bench).

    Runs on any one thread at a time.
    """

    def __init__(self, union: Any, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)
        self._decode = self._decoder.decode
        self._tags = _known_tags(union)

    def encode(self, message: T) -> bytes:
        """The message's bytes. Raises ProtocolError if they exceed ``max_message_bytes``."""
        data = self._encode(message)
        if len(data) > self.max_message_bytes:
            raise ProtocolError(
                f"oversize: a {type(message).__name__} of {len(data)} bytes exceeds "
                f"max_message_bytes={self.max_message_bytes}"
            )
        return data

    def try_decode(self, data: bytes) -> T | Refusal:
        """The message, or the reason it is refused (never raises)."""
        if len(data) > self.max_message_bytes:
            return Refusal(
                "oversize", f"{len(data)} bytes exceed max_message_bytes={self.max_message_bytes}"
            )
        try:
            return self._decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Refusal(*_classify(exc, data, self._tags))

    def decode(self, data: bytes) -> T:
        """The message. Raises ProtocolError naming what was wrong."""
        if len(data) <= self.max_message_bytes:
            try:
                return self._decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        refusal = self.try_decode(data)
        assert isinstance(refusal, Refusal)
        raise refusal.error()
