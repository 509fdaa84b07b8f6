"""Frame and message codecs: round trips, and a precise reason for every refusal."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from dynarl.bus import BusConfig, MessageCodec, Sample, WorkerMetrics, pack_tokens, unpack_tokens
from dynarl.bus._codec import Frame, FrameCodec, Refusal
from dynarl.bus._messages import Ack, ChannelPut, ControlMessage, Ping
from dynarl.errors import ProtocolError

raw = msgspec.msgpack.encode


def refusal(data: bytes, limit: int = 4096) -> Refusal:
    result = FrameCodec(limit).decode(data)
    assert isinstance(result, Refusal), result
    return result


def test_frame_round_trip() -> None:
    codec = FrameCodec(4096)
    frame = codec.decode(codec.encode(1, 42, 1500, Ping(seq=7, payload=b"x")))
    assert frame == Frame(kind=1, request_id=42, timeout_ms=1500, body=Ping(seq=7, payload=b"x"))


def test_cancel_frames_carry_no_body() -> None:
    codec = FrameCodec(4096)
    assert codec.decode(codec.encode(4, 9, 0, None)) == Frame(
        kind=4, request_id=9, timeout_ms=0, body=None
    )


@pytest.mark.parametrize(
    ("data", "reason", "words"),
    [
        (b"\xc1", "malformed", "MessagePack array"),
        (raw({"kind": 1}), "malformed", "array"),
        (raw([1, 2, 3]), "malformed", "array"),
        (raw(["1", 2, 3, None]), "malformed", "array"),
        (raw([1, -5, 0, None]), "malformed", "request_id"),
        (raw([9, 5, 0, {"type": "Ping"}]), "unknown_kind", "kind 9"),
        (raw([1, 5, 0, {"type": "Pingg"}]), "unknown_tag", "'Pingg'"),
        (raw([1, 5, 0, {"type": 3}]), "unknown_tag", "must be a string"),
        (raw([1, 5, 0, {"type": "Ping", "seq": "one"}]), "invalid", "$.seq"),
        (raw([1, 5, 0, {"seq": 1}]), "invalid", "type"),
        (raw([1, 5, 0, 17]), "invalid", "object"),
        (raw([1, 5, 0, msgspec.Raw(b"\xc1")]), "malformed", "invalid opcode"),
    ],
)
def test_refusals_name_what_was_wrong(data: bytes, reason: str, words: str) -> None:
    result = refusal(data)
    assert result.reason == reason
    assert words in result.message
    assert reason in str(result.error())


def test_refusal_keeps_the_request_id_when_it_can_be_read() -> None:
    assert refusal(raw([1, 77, 0, {"type": "Nope"}])).request_id == 77
    assert refusal(b"\xc1").request_id == 0


def test_unknown_tag_nested_in_a_known_message_is_named() -> None:
    body = {"type": "ChannelPut", "channel": "c", "key": "", "capacity": 1}
    body["item"] = {"type": "Mystery"}
    result = refusal(raw([1, 3, 0, body]))
    assert result.reason == "invalid" and "'Mystery'" in result.message


def test_oversize_is_refused_on_both_ends() -> None:
    codec = FrameCodec(300)
    big = Ping(payload=b"x" * 400)
    with pytest.raises(ProtocolError, match="oversize"):
        codec.encode(1, 1, 0, big)
    result = codec.decode(FrameCodec(4096).encode(1, 1, 0, big))
    assert isinstance(result, Refusal) and result.reason == "oversize"


def test_message_codec_is_typed_per_union() -> None:
    codec: MessageCodec[object] = MessageCodec(ControlMessage, 4096)
    report = WorkerMetrics(component="c", worker=0, time=1.0, interval_s=1.0, utilization=0.5)
    assert codec.decode(codec.encode(report)) == report
    sample = Sample(sample_id="s", token_ids=b"", prompt_len=0)
    with pytest.raises(ProtocolError, match="unknown_tag: unknown message type 'Sample'"):
        codec.decode(codec.encode(sample))  # a data message is not a control message


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    frame = FrameCodec(4096).decode(raw([2, 1, 0, {"type": "Ack", "detail": "", "new": 1}]))
    assert isinstance(frame, Frame) and frame.body == Ack()


def test_tokens_pack_as_little_endian_int32() -> None:
    ids = [0, 1, 2**31 - 1, -(2**31), 151_000]
    packed = pack_tokens(ids)
    assert packed == np.array(ids, dtype="<i4").tobytes()
    assert unpack_tokens(packed).tolist() == ids
    assert unpack_tokens(pack_tokens(np.arange(5, dtype=np.int64))).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bad", [[2**31], [-(2**31) - 1], [[1, 2]]])
def test_pack_tokens_refuses_what_does_not_fit(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        pack_tokens(bad)


def test_unpack_tokens_refuses_ragged_bytes() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack_tokens(b"\x00\x00\x00")


def test_channel_put_nests_a_tagged_item() -> None:
    codec = FrameCodec(1 << 16)
    put = ChannelPut(
        channel="samples",
        key="k",
        capacity=4,
        item=Sample(sample_id="a", token_ids=pack_tokens([5, 6]), prompt_len=1, reward=0.5),
    )
    frame = codec.decode(codec.encode(1, 2, 0, put))
    assert isinstance(frame, Frame) and frame.body == put


@pytest.mark.parametrize(
    "kwargs",
    [
        {"heartbeat_interval_s": 0},
        {"heartbeat_interval_s": float("inf")},
        {"num_missed_heartbeats": 0},
        {"max_message_bytes": 10},
        {"max_message_bytes": 2**31},
        {"default_timeout_s": -1.0},
        {"channel_capacity": 0},
        {"send_hwm": True},
    ],
)
def test_bus_config_range_checks(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        BusConfig(**kwargs)  # type: ignore[arg-type]


def test_bus_config_derived_figures() -> None:
    config = BusConfig(heartbeat_interval_s=0.5, num_missed_heartbeats=4, max_message_bytes=1024)
    assert config.loss_after_s == 2.0
    assert config.check_interval_s == 0.125
    assert config.zmq_max_message_bytes == 2048
