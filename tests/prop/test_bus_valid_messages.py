"""What a valid bus message is, declared on the message types: decode refuses anything
else, naming the field; ``message_strategy`` draws only valid messages, which decode and
the role that consumes each accept; ``arbitrary_message_strategy`` still draws values
decode refuses (for fuzzing).

A broken rule is derived from the rules each type declares (``msgspec.inspect``), so every
rule added to a message is tested here without a new test.
"""

from __future__ import annotations

import asyncio
import math
import re
from contextlib import suppress
from typing import Any

import msgpack
import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from dynarl.bus import MessageCodec
from dynarl.bus._channel import ChannelTable
from dynarl.bus._codec import FrameCodec, Refusal
from dynarl.bus._messages import (
    ChannelGet,
    ChannelPut,
    EventMessage,
    GenerationRequest,
    Message,
    Sample,
    unpack_tokens,
)
from dynarl.errors import DeadlineExceeded, ProtocolError
from dynarl.runtime import FINISH, RoleContext
from dynarl.runtime.controller._progress import Progress
from dynarl.runtime.worker import ComputeThread
from dynarl.testing import (
    ScriptedRollout,
    TinyState,
    TinyTrainer,
    arbitrary_message_strategy,
    message_strategy,
)

ALL = Message | EventMessage
FRAMES = FrameCodec(1 << 24)
CODEC: MessageCodec[Any] = MessageCodec(ALL, 1 << 24)
I64 = (-(2**63), 2**63 - 1)


def wire(message: Any) -> dict[str, Any]:
    """The message as the map a client in another language would send."""
    mapping: dict[str, Any] = msgpack.unpackb(msgspec.msgpack.encode(message), raw=False)
    return mapping


REQUEST_REPLY = {struct.__name__ for struct in Message.__args__}


def refusal(mapping: dict[str, Any]) -> Refusal:
    """Why decoding refuses ``mapping``: in a request frame (request/reply socket), or as
    a bare event (publish/subscribe)."""
    if mapping["type"] in REQUEST_REPLY:
        refused = FRAMES.decode(msgpack.packb([1, 7, 0, mapping], use_bin_type=True))
    else:
        refused = CODEC.try_decode(msgpack.packb(mapping, use_bin_type=True))
    assert isinstance(refused, Refusal), f"decoded {mapping!r}"
    return refused


# ------------------------------------------------------------------ the issue's example


ISSUE = {
    "type": "GenerationRequest",
    "sample_id": "s",
    "token_ids": b"\x01\x00\x00\x00",
    "max_new_tokens": 1,
}


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("sample_id", "", "length >= 1"),
        ("token_ids", b"\x00", "multiple of 4 bytes, got 1"),
        ("max_new_tokens", -1, ">= 1"),
        ("temperature", -0.5, ">= 0.0"),
        ("top_p", 0.0, "> 0.0"),
        ("temperature", math.nan, ">= 0.0"),
    ],
)
def test_decode_refuses_an_invalid_generation_request_naming_the_field(
    field: str, value: object, words: str
) -> None:
    bad = {**ISSUE, field: value}
    refused = refusal(bad)
    assert (refused.reason, refused.request_id) == ("invalid", 7)
    assert field in refused.message and words in refused.message, refused.message
    with pytest.raises(ProtocolError, match=f"^invalid: invalid GenerationRequest: .*{field}"):
        CODEC.decode(msgpack.packb(bad, use_bin_type=True))


def test_a_rule_broken_inside_a_nested_message_is_named_with_its_path() -> None:
    item = {**ISSUE, "token_ids": b"\x00"}
    put = {"type": "ChannelPut", "channel": "c", "key": "k", "item": item, "capacity": 1}
    message = refusal(put).message
    assert "token_ids" in message and "$.item" in message, message
    assert "$.capacity" in refusal({**put, "item": ISSUE, "capacity": 0}).message


def test_the_rules_msgspec_cannot_express_hold_on_construction_too() -> None:
    with pytest.raises(ValueError, match="token_ids must be packed little-endian int32"):
        GenerationRequest(sample_id="s", token_ids=b"\x00", max_new_tokens=1)
    with pytest.raises(ValueError, match="logprobs must be packed little-endian float32"):
        Sample(sample_id="s", token_ids=b"", prompt_len=0, logprobs=b"\x00\x00")
    with pytest.raises(ValueError, match=r"prompt_len must be at most .* token_ids \(1\), got 2"):
        Sample(sample_id="s", token_ids=b"\x01\x00\x00\x00", prompt_len=2)


# ------------------------------------------------------------------ every declared rule


def _float_breaker(info: mi.FloatType) -> SearchStrategy[float] | None:
    bounds = (info.ge, info.gt, info.le, info.lt)
    if all(bound is None for bound in bounds):
        return None

    def breaks(x: float) -> bool:
        return not (
            (info.ge is None or x >= info.ge)
            and (info.gt is None or x > info.gt)
            and (info.le is None or x <= info.le)
            and (info.lt is None or x < info.lt)
        )

    return st.one_of(st.just(math.nan), st.floats()).filter(breaks)


def _int_breaker(info: mi.IntType) -> SearchStrategy[int] | None:
    options = []
    if info.ge is not None and info.ge > I64[0]:
        options.append(st.integers(I64[0], info.ge - 1))
    if info.gt is not None:
        options.append(st.integers(I64[0], info.gt))
    if info.le is not None and info.le < I64[1]:
        options.append(st.integers(info.le + 1, I64[1]))
    if info.lt is not None:
        options.append(st.integers(info.lt, I64[1]))
    return st.one_of(options) if options else None


def _str_breaker(info: mi.StrType) -> SearchStrategy[str] | None:
    options = []
    if info.min_length:
        options.append(st.text(max_size=info.min_length - 1))
    if info.max_length is not None:
        options.append(st.text(min_size=info.max_length + 1, max_size=info.max_length + 4))
    if info.pattern is not None:
        pattern = info.pattern
        options.append(st.text(max_size=12).filter(lambda s: re.search(pattern, s) is None))
    return st.one_of(options) if options else None


def breaker(info: mi.Type, mapping: dict[str, Any]) -> SearchStrategy[Any] | None:
    """Values that break a rule ``info`` declares (None: it declares none)."""
    extra = dict(info.extra or {}) if isinstance(info, mi.Metadata) else {}
    if "packed" in extra:
        size = np.dtype(extra["packed"]).itemsize
        return st.binary(max_size=4 * size).filter(lambda data: len(data) % size != 0)
    if "max_items_of" in extra:
        count = len(mapping[extra["max_items_of"]]) // 4
        return st.integers(count + 1, count + 1000)
    inner = info.type if isinstance(info, mi.Metadata) else info
    match inner:
        case mi.IntType():
            return _int_breaker(inner)
        case mi.FloatType():
            return _float_breaker(inner)
        case mi.StrType():
            return _str_breaker(inner)
        case mi.VarTupleType(item_type=item):
            bad = breaker(item, mapping)
            return None if bad is None else st.lists(bad, min_size=1, max_size=3)
        case mi.UnionType(types=types):
            members = [breaker(member, mapping) for member in types]
            found = [member for member in members if member is not None]
            return st.one_of(found) if found else None
    return None


def _ruled_types() -> list[type]:
    """The message types that declare at least one rule."""
    out = []
    for struct in ALL.__args__:
        info = mi.type_info(struct)
        assert isinstance(info, mi.StructType)
        # A valid map only matters for "max_items_of"; a stand-in one is enough here.
        stand_in = {f.name: b"" for f in info.fields}
        if any(breaker(f.type, stand_in) is not None for f in info.fields):
            out.append(struct)
    return out


RULED = _ruled_types()


@st.composite
def broken(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid message's wire map with one declared rule of one field broken."""
    struct = draw(st.sampled_from(RULED))
    mapping = wire(draw(message_strategy(struct)))
    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    breakers = {f.name: breaker(f.type, mapping) for f in info.fields}
    name = draw(st.sampled_from(sorted(n for n, b in breakers.items() if b is not None)))
    strategy = breakers[name]
    assert strategy is not None
    mapping[name] = draw(strategy)
    return name, mapping


def test_the_messages_declare_rules() -> None:
    names = {struct.__name__ for struct in RULED}
    assert {"GenerationRequest", "Sample", "Register", "Welcome", "ChannelPut"} <= names


@given(broken())
def test_decode_refuses_every_broken_rule_naming_the_field(
    case: tuple[str, dict[str, Any]],
) -> None:
    name, mapping = case
    refused = refusal(mapping)
    assert refused.reason == "invalid", refused
    assert name in refused.message, refused.message


# ------------------------------------------------------------------ the valid strategy


@given(message_strategy(ALL))
def test_every_valid_message_decodes_to_itself(message: Any) -> None:
    frame = (
        FRAMES.decode(FRAMES.encode(1, 3, 0, message))
        if type(message) in Message.__args__
        else None
    )
    assert frame is None or (not isinstance(frame, Refusal) and frame.body == message), frame
    assert CODEC.decode(CODEC.encode(message)) == message


def _context() -> RoleContext:
    return RoleContext(
        component="rollout",
        device=0,
        devices=(0,),
        options={"tokens_per_s": 1e6, "vocab": 50},
        epoch=0,
        compute=ComputeThread(),
        store=lambda: pytest.fail("no store in this test"),
        backend=ChannelTable(),
    )


async def _serve(request: GenerationRequest) -> Sample:
    """``request`` served by a ScriptedRollout, aborted after a few decode steps."""
    rollout = ScriptedRollout(_context())
    engine = asyncio.create_task(rollout.run())
    serving = asyncio.create_task(rollout.serve(request))
    try:
        await asyncio.sleep(0.001)
        await rollout.abort()
        return await serving
    finally:
        engine.cancel()
        with suppress(asyncio.CancelledError):
            await engine


@settings(max_examples=50)
@given(message_strategy(GenerationRequest))
def test_a_valid_request_is_served_and_its_continuation_is_valid(
    request: GenerationRequest,
) -> None:
    frame = FRAMES.decode(FRAMES.encode(1, 1, 0, request))  # the worker's decode path
    assert not isinstance(frame, Refusal) and frame.body == request, frame
    sample = asyncio.run(_serve(frame.body))
    assert CODEC.decode(CODEC.encode(sample)) == sample
    prompt = unpack_tokens(request.token_ids)
    tokens = unpack_tokens(sample.token_ids)
    generated = len(tokens) - len(prompt)
    assert sample.prompt_len == len(prompt) and (tokens[: len(prompt)] == prompt).all()
    assert 0 <= generated <= request.max_new_tokens
    assert (sample.metadata[FINISH] == "length") == (generated == request.max_new_tokens)
    # the dispatcher folds the output in; what it sends next is valid too
    progress = Progress(request)
    final = progress.absorb(sample)
    if final is None:
        again = progress.next_request()
        assert isinstance(again, GenerationRequest)
        assert again.max_new_tokens == request.max_new_tokens - generated
        assert CODEC.decode(CODEC.encode(again)) == again
    else:
        assert CODEC.decode(CODEC.encode(final)) == final


OPTIONS = {"hidden": 4, "num_layers": 1}
TRAINER = TinyState(OPTIONS, TinyTrainer.plan_layout(OPTIONS, (0,)), 0)
TRAINER.initialise()


@settings(max_examples=50)
@given(message_strategy(Sample))
def test_a_valid_sample_is_trained_on(sample: Sample) -> None:
    decoded = CODEC.decode(CODEC.encode(sample))
    assert decoded == sample
    assert math.isfinite(TRAINER.step([decoded], 1e-3, None))
    assert Progress(decoded).next_request() is decoded  # passed through as it is


@settings(max_examples=50)
@given(message_strategy(ChannelPut), message_strategy(ChannelGet))
def test_valid_channel_messages_are_served_by_the_channel_table(
    put: ChannelPut, get: ChannelGet
) -> None:
    async def main() -> None:
        table = ChannelTable()
        await table.channel_put(put.channel, put.key, put.item, capacity=put.capacity, timeout=1)
        item = await table.channel_get(put.channel, put.key, capacity=get.capacity, timeout=1)
        assert item == put.item
        with pytest.raises(DeadlineExceeded, match="stayed empty"):
            await table.channel_get(get.channel, get.key, capacity=get.capacity, timeout=0)

    asyncio.run(main())


# ------------------------------------------------------------------ the arbitrary strategy


@given(arbitrary_message_strategy(ALL))
def test_an_arbitrary_message_decodes_to_itself_or_is_refused_as_invalid(message: Any) -> None:
    outcome = CODEC.try_decode(CODEC.encode(message))
    assert outcome == message or (isinstance(outcome, Refusal) and outcome.reason == "invalid")


SEARCH = settings(database=None, max_examples=2000)  # find() stops at the first hit


def test_the_arbitrary_strategy_draws_what_decode_refuses() -> None:
    def refused(message: Any) -> bool:
        return isinstance(CODEC.try_decode(CODEC.encode(message)), Refusal)

    for struct in (GenerationRequest, Sample):  # a rule msgspec checks, and an extra rule
        found = find(arbitrary_message_strategy(struct), refused, settings=SEARCH)
        assert type(found) is struct

    def odd_tokens(message: GenerationRequest) -> bool:
        outcome = CODEC.try_decode(CODEC.encode(message))
        return isinstance(outcome, Refusal) and "token_ids must be packed" in outcome.message

    find(arbitrary_message_strategy(GenerationRequest), odd_tokens, settings=SEARCH)
