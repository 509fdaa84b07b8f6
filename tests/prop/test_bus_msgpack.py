"""Conformance with plain MessagePack: the wire format is standard, not msgspec's own.

Every generated message, valid or not, is decoded by the plain ``msgpack`` package into
the documented map (``"type"`` = class name, one key per field), and a frame built by plain
``msgpack`` from the map of a valid message decodes to the equal Struct.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
from hypothesis import given
from hypothesis import strategies as st

from dynarl.bus import MessageCodec
from dynarl.bus._codec import Frame, FrameCodec
from dynarl.bus._messages import EventMessage, Message
from dynarl.testing import arbitrary_message_strategy, message_strategy

ANY_MESSAGE = message_strategy(Message | EventMessage)
ANY_VALUES = arbitrary_message_strategy(Message | EventMessage)  # valid or not
FRAMES = FrameCodec(1 << 24)
EVENTS: MessageCodec[Any] = MessageCodec(EventMessage, 1 << 24)
REQUESTS: MessageCodec[Any] = MessageCodec(Message, 1 << 24)


def plain(value: Any) -> Any:
    """The documented wire form, built without msgspec's encoder."""
    if isinstance(value, msgspec.Struct):
        config = value.__struct_config__
        out: dict[str, Any] = {config.tag_field: config.tag} if config.tag else {}
        out.update({name: plain(getattr(value, name)) for name in value.__struct_fields__})
        return out
    if isinstance(value, tuple | list):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value


@given(ANY_VALUES)
def test_plain_msgpack_reads_every_message(message: Any) -> None:
    data = msgspec.msgpack.encode(message)
    decoded = msgpack.unpackb(data, raw=False)
    assert decoded == plain(message)
    assert decoded["type"] == type(message).__name__
    assert set(decoded) == {"type", *message.__struct_fields__}


@given(ANY_MESSAGE)
def test_a_plain_msgpack_map_decodes_to_the_equal_struct(message: Any) -> None:
    data = msgpack.packb(plain(message), use_bin_type=True)
    codec = EVENTS if type(message) in EventMessage.__args__ else REQUESTS
    assert codec.decode(data) == message


@given(
    message_strategy(Message),
    st.sampled_from([1, 2, 3]),
    st.integers(0, 2**63 - 1),
    st.integers(0, 2**32 - 1),
)
def test_a_plain_msgpack_frame_decodes_to_the_equal_frame(
    message: Any, kind: int, request_id: int, timeout_ms: int
) -> None:
    data = msgpack.packb([kind, request_id, timeout_ms, plain(message)], use_bin_type=True)
    assert FRAMES.decode(data) == Frame(
        kind=kind, request_id=request_id, timeout_ms=timeout_ms, body=message
    )
    assert msgpack.unpackb(FRAMES.encode(kind, request_id, timeout_ms, message), raw=False) == [
        kind,
        request_id,
        timeout_ms,
        plain(message),
    ]
