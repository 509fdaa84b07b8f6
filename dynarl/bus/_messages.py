"""Typed wire messages, one tagged union per channel.

Every message is a ``msgspec.Struct`` with ``tag=True`` (the tag is the class name, carried
in the ``"type"`` field of a MessagePack map), ``frozen=True`` and ``kw_only=True``.

- :data:`ControlMessage`: registration, heartbeats, metrics reports, interrupts, migration
  phases and their acknowledgements or errors (request/reply socket);
- :data:`DataMessage`: samples, generation requests and channel operations (request/reply
  socket);
- :data:`EventMessage`: ledger records, reports and peer events (publish/subscribe socket).

``docs/wire.md`` documents every field for clients written in other languages.

**What a valid message is** is declared on the types themselves, so that decoding enforces
it and ``dynarl.testing.message_strategy`` draws only valid messages:

- ``msgspec`` constraints in ``Annotated[..., msgspec.Meta(...)]`` (``ge``, ``gt``, ``le``,
  ``min_length``, ``max_length``, ``pattern``); every float field of this module's
  messages is finite (its bounds are at most the largest float), so NaN and infinities are
  refused;
- two rules ``Meta`` cannot express, declared in its ``extra`` and enforced by the type's
  ``__post_init__`` (which runs on construction *and* on decoding; ``_refuse`` names the
  broken rule):
  ``extra={"packed": "<i4"}`` (or ``"<f4"``) on a bytes field: a packed little-endian array
  of that NumPy dtype, so its length is a multiple of the item size;
  ``extra={"max_items_of": "token_ids"}`` on an int field: at most the number of items of
  that packed field.

The ``Meta`` constraints are checked when a message is decoded (a receiver refuses it with
``invalid``, naming the field), not when it is constructed; the ``extra`` rules are checked
both times (``ValueError`` on construction).
"""

from __future__ import annotations

import functools
import sys
import typing
from typing import Annotated, Final, NoReturn, get_args

import msgspec
import numpy as np
import numpy.typing as npt

from dynarl.bus._report_records import (
    ComponentReport,
    DecisionRecord,
    MigrationRecord,
    WorkerMetrics,
)

__all__ = [
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "SUPPORTED_PROTOCOLS",
    "Ack",
    "ChannelGet",
    "ChannelItem",
    "ChannelPut",
    "ControlMessage",
    "DataItem",
    "DataMessage",
    "Envelope",
    "ErrorReply",
    "EventMessage",
    "GenerationRequest",
    "Heartbeat",
    "Interrupt",
    "Message",
    "MetaValue",
    "MigrationAbort",
    "MigrationCommit",
    "MigrationPrepare",
    "MigrationTransfer",
    "PeerEvent",
    "Ping",
    "Pong",
    "Register",
    "Sample",
    "Unregister",
    "Welcome",
    "pack_tokens",
    "unpack_tokens",
]

PROTOCOL_VERSION: Final = 1
"""The wire protocol version this build speaks (sent in ``Register`` and ``Welcome``)."""
SUPPORTED_PROTOCOLS: Final = frozenset({1})
"""Protocol versions a server accepts in ``Register``."""

MetaValue = str | int | float | bool | None
"""A metadata value: a MessagePack scalar."""

_FLOAT_MAX: Final = sys.float_info.max
_Finite = Annotated[float, msgspec.Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]
_Positive = Annotated[float, msgspec.Meta(gt=0.0, le=_FLOAT_MAX)]
_Id = Annotated[str, msgspec.Meta(min_length=1)]
_PeerName = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
_Protocol = Annotated[int, msgspec.Meta(ge=1)]
_Device = Annotated[int, msgspec.Meta(ge=0)]
_Capacity = Annotated[int, msgspec.Meta(ge=1)]
_TokenIds = Annotated[bytes, msgspec.Meta(extra={"packed": "<i4"})]
_Floats = Annotated[bytes, msgspec.Meta(extra={"packed": "<f4"})]
_PromptLen = Annotated[int, msgspec.Meta(ge=0, extra={"max_items_of": "token_ids"})]
_MIGRATION_KINDS: Final = "^(workload|p2p|reboot)$"
_PEER_EVENTS: Final = "^(registered|left|lost)$"


# ----------------------------------------------------------------------------- control


class Register(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """First request of every client: who it is and which protocol it speaks."""

    protocol: _Protocol
    """Wire protocol version the client speaks (at least 1); refused unless the server
    supports it."""
    name: _PeerName
    """Unique peer name on this server, 1-200 characters (for instance ``"rollout/3"``)."""
    role: str = ""
    """Free-form role of the process (``"worker"``, ``"manager"``, ...)."""
    component: str = ""
    """Logical component the peer belongs to, if any."""
    worker: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """Worker index within the component (at least 0), or -1."""
    pid: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Operating-system process id of the peer, at least 0 (informative)."""
    host: str = ""
    """Host name of the peer (informative)."""
    devices: tuple[_Device, ...] = ()
    """Device ids the peer holds (each at least 0)."""


class Welcome(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Reply to ``Register``: the server's protocol version and the settings to adopt."""

    protocol: _Protocol
    """Wire protocol version of the server (at least 1)."""
    server: str
    """Name of the server."""
    peer: _PeerName
    """The name the peer was registered under (1-200 characters)."""
    heartbeat_interval_s: _Positive
    """Seconds between heartbeats the client must send (positive)."""
    num_missed_heartbeats: Annotated[int, msgspec.Meta(ge=1)]
    """Silent intervals after which either side declares the other lost (at least 1)."""
    max_message_bytes: Annotated[int, msgspec.Meta(ge=256, le=1 << 30)]
    """Largest frame the server accepts (256 bytes to 1 GiB)."""


class Unregister(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Notification that the sender is leaving; its pending requests fail at once."""

    reason: str = ""
    """Why it leaves (informative)."""


class Heartbeat(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Liveness notification; a server echoes each one back to its sender."""

    seq: Annotated[int, msgspec.Meta(ge=0)]
    """Sender's heartbeat counter (from 0)."""
    time: _Finite = 0.0
    """Sender's monotonic clock when sent, seconds (informative)."""


class Ping(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Echo request: the receiver replies ``Pong`` with the same ``seq`` and ``payload``."""

    seq: int = 0
    """Caller's sequence number."""
    payload: bytes = b""
    """Opaque bytes echoed back."""


class Pong(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Reply to ``Ping``."""

    seq: int = 0
    """The ``Ping``'s sequence number."""
    payload: bytes = b""
    """The ``Ping``'s payload."""


class Interrupt(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Ask a component to reach its next interruptible point (batch or query boundary)."""

    component: _Id
    """Component to interrupt (not empty)."""
    reason: str = ""
    """Why (informative: a migration id, an operator command)."""


class MigrationPrepare(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Phase 1 of a migration: reserve resources and stage what the move needs."""

    migration_id: _Id
    """Unique id of the migration (not empty); every phase is idempotent per id."""
    decision_id: _Id
    """Decision that caused the migration (not empty)."""
    kind: Annotated[str, msgspec.Meta(pattern=_MIGRATION_KINDS)]
    """A ``dynarl.MigrationKind`` value: ``"workload"``, ``"p2p"`` or ``"reboot"``."""
    component: _Id
    """Component whose state moves (not empty)."""
    src_devices: tuple[_Device, ...]
    """Devices the component holds now (each at least 0)."""
    dst_devices: tuple[_Device, ...]
    """Devices it will hold after commit (each at least 0)."""
    lease_deadline: _Finite
    """Wall-clock time (UNIX seconds) after which the receiver aborts the migration itself."""


class MigrationTransfer(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Phase 2: move the state (p2p tensors, re-dispatched requests)."""

    migration_id: _Id
    """The migration (not empty)."""
    lease_deadline: _Finite
    """Wall-clock time (UNIX seconds) by which the transfer must finish."""


class MigrationCommit(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Phase 3: switch to the new resources and free the old ones."""

    migration_id: _Id
    """The migration (not empty)."""
    lease_deadline: _Finite
    """Wall-clock time (UNIX seconds) by which the commit must finish."""


class MigrationAbort(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Abandon a migration and roll back to the previous resources."""

    migration_id: _Id
    """The migration (not empty)."""
    reason: str = ""
    """Why it is aborted."""


class Ack(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Positive reply carrying no data."""

    detail: str = ""
    """Optional detail (informative)."""


class ErrorReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Negative reply: the request (or a frame) was refused or failed."""

    code: _Id
    """Machine-readable reason, not empty (``docs/wire.md`` lists them)."""
    message: str
    """What was wrong, for humans."""


class Envelope(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A message of a protocol layered on the bus (the runtime's worker protocol).

    The bus carries it as it is; the layer named by ``protocol`` decodes ``body`` with its
    own typed decoder. A request's reply is another ``Envelope`` (or ``Ack``/``ErrorReply``).
    """

    protocol: _Id
    """Name and version of the inner protocol, not empty (for instance ``"dynarl.runtime/1"``)."""
    body: bytes
    """The inner message: one tagged MessagePack map of that protocol."""


# ----------------------------------------------------------------------------- data


class Sample(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One trajectory: prompt and response tokens with its reward."""

    sample_id: _Id
    """Unique, stable id, not empty (the trainer's manifests list these)."""
    token_ids: _TokenIds
    """Prompt then response token ids, packed little-endian int32 (:func:`pack_tokens`)."""
    prompt_len: _PromptLen
    """Number of prompt tokens at the front of ``token_ids`` (0 to the number of tokens)."""
    prompt_id: str = ""
    """Id of the prompt (samples of one GRPO group share it)."""
    reward: _Finite | None = None
    """Reward, once known."""
    logprobs: _Floats = b""
    """Per-response-token log-probabilities, packed little-endian float32, or empty."""
    policy_version: Annotated[int, msgspec.Meta(ge=-1)] = 0
    """Version of the policy weights that generated the response, or -1 if unknown."""
    metadata: dict[str, MetaValue] = {}
    """Free-form scalar metadata (task id, turn, tool calls, ...)."""

    def __post_init__(self) -> None:
        # The declared extra rules, inlined for speed; _refuse says which one broke.
        tokens = len(self.token_ids)
        if tokens % 4 or len(self.logprobs) % 4 or self.prompt_len > tokens // 4:
            _refuse(self)


class GenerationRequest(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Ask a rollout engine to continue a prompt."""

    sample_id: _Id
    """Id the resulting ``Sample`` will carry (not empty)."""
    token_ids: _TokenIds
    """Prompt token ids, packed little-endian int32."""
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)]
    """Upper bound on generated tokens (at least 1)."""
    prompt_id: str = ""
    """Id of the prompt (group)."""
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=_FLOAT_MAX)] = 1.0
    """Sampling temperature (at least 0; 0 is greedy)."""
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling threshold, in (0, 1]."""
    seed: int | None = None
    """Sampling seed (deterministic mode keys randomness by seed, sample id and position)."""
    priority: int = 0
    """Scheduling priority; higher runs first."""
    metadata: dict[str, MetaValue] = {}
    """Free-form scalar metadata."""

    def __post_init__(self) -> None:
        if len(self.token_ids) % 4:  # the declared extra rule, inlined for speed
            _refuse(self)


DataItem = Sample | GenerationRequest
"""What a ``Channel`` carries."""


class ChannelPut(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Append ``item`` to the channel queue ``(channel, key)``; the ``Ack`` waits for room."""

    channel: str
    """Channel name."""
    key: str
    """Queue key within the channel."""
    item: DataItem
    """The item."""
    capacity: _Capacity
    """Bound of the queue if this call creates it, at least 1 (an existing queue keeps its
    bound)."""


class ChannelGet(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Take the oldest item of ``(channel, key)``; the ``ChannelItem`` reply waits for one."""

    channel: str
    """Channel name."""
    key: str
    """Queue key within the channel."""
    capacity: _Capacity
    """Bound of the queue if this call creates it, at least 1 (an existing queue keeps its
    bound)."""


class ChannelItem(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Reply to ``ChannelGet``."""

    channel: str
    """Channel the item was taken from."""
    key: str
    """Queue key it was taken from."""
    item: DataItem
    """The item taken."""


# ----------------------------------------------------------------------------- events


class PeerEvent(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A peer registered, left or was lost (published for the ledger and dashboards)."""

    peer: _PeerName
    """Peer name (1-200 characters)."""
    event: Annotated[str, msgspec.Meta(pattern=_PEER_EVENTS)]
    """``"registered"``, ``"left"`` or ``"lost"``."""
    time: _Finite
    """Wall-clock time (UNIX seconds)."""
    role: str = ""
    """The peer's declared role."""
    reason: str = ""
    """Why a peer that left did (its ``Unregister`` reason; "" for other events)."""


ControlMessage = (
    Register
    | Welcome
    | Unregister
    | Heartbeat
    | Ping
    | Pong
    | WorkerMetrics
    | ComponentReport
    | Interrupt
    | MigrationPrepare
    | MigrationTransfer
    | MigrationCommit
    | MigrationAbort
    | Ack
    | ErrorReply
    | Envelope
)
"""Messages of the control channel."""
DataMessage = Sample | GenerationRequest | ChannelPut | ChannelGet | ChannelItem
"""Messages of the data channel."""
EventMessage = DecisionRecord | MigrationRecord | ComponentReport | PeerEvent
"""Messages of the event channel (publish/subscribe)."""
Message = ControlMessage | DataMessage
"""What the request/reply socket carries: the control and data channels."""
MESSAGE_TYPES: Final = frozenset(get_args(Message))
"""The message classes of :data:`Message` (what a request/reply handler may be routed)."""

_TOKEN_DTYPE: Final = np.dtype("<i4")
_DTYPE_NAMES: Final = {"<i4": "little-endian int32", "<f4": "little-endian float32"}


@functools.cache
def _extra_rules(cls: type) -> tuple[tuple[str, str, str, int], ...]:
    """``(field, rule, argument, item size)`` for every rule declared in a field's
    ``Meta.extra``, ``packed`` ones first (read once per class; item size 0 unless packed).

    Raises ValueError for a rule this module does not enforce.
    """
    rules: list[tuple[str, str, str, int]] = []
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        for meta in getattr(hint, "__metadata__", ()):
            if not (isinstance(meta, msgspec.Meta) and meta.extra):
                continue
            for rule, arg in meta.extra.items():
                if rule not in ("packed", "max_items_of"):
                    raise ValueError(f"{cls.__name__}.{name}: unknown rule {rule!r}")
                size = np.dtype(arg).itemsize if rule == "packed" else 0
                rules.append((name, rule, str(arg), size))
    return tuple(sorted(rules, key=lambda rule: rule[1] != "packed"))


def _refuse(message: msgspec.Struct) -> NoReturn:
    """Raise ValueError naming the field of ``message`` that breaks a ``Meta.extra`` rule
    (see the module docstring); ``msgspec`` turns it into a ``ValidationError`` when
    decoding. A type's ``__post_init__`` checks its rules inline and calls this only when
    one fails (``tests/prop/test_bus_valid_messages.py`` breaks every declared rule, so
    the two cannot drift apart unnoticed)."""
    items: dict[str, int] = {}
    for name, rule, arg, size in _extra_rules(type(message)):
        value = getattr(message, name)
        if rule == "packed":
            if len(value) % size:
                raise ValueError(
                    f"{name} must be packed {_DTYPE_NAMES.get(arg, arg)}: a multiple of "
                    f"{size} bytes, got {len(value)}"
                )
            items[name] = len(value) // size
        elif value > items[arg]:
            raise ValueError(
                f"{name} must be at most the number of items of {arg} ({items[arg]}), got {value}"
            )
    raise ValueError(f"invalid {type(message).__name__}: {message!r}")


def pack_tokens(token_ids: npt.ArrayLike) -> bytes:
    """Pack token ids as little-endian int32 bytes (the wire form of ``token_ids``).

    Raises ValueError if an id does not fit in int32 or the input is not one-dimensional.
    """
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {array.shape}")
    if array.dtype != _TOKEN_DTYPE:
        if array.size and (array.min() < -(2**31) or array.max() >= 2**31):
            raise ValueError("token ids must fit in int32")
        array = array.astype(_TOKEN_DTYPE)
    return array.tobytes()


def unpack_tokens(data: bytes) -> npt.NDArray[np.int32]:
    """A read-only int32 view of packed token ids (no copy).

    Raises ValueError if the length is not a multiple of four bytes.
    """
    if len(data) % 4:
        raise ValueError(f"packed token ids must be a multiple of 4 bytes, got {len(data)}")
    return np.frombuffer(data, dtype=_TOKEN_DTYPE)


def pack_floats(values: npt.ArrayLike) -> bytes:
    """Little-endian float32 bytes (the wire form of ``Sample.logprobs``)."""
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_floats(data: bytes) -> list[float]:
    """The floats of :func:`pack_floats` bytes; ValueError unless a multiple of 4 bytes."""
    if len(data) % 4:
        raise ValueError(f"packed floats must be a multiple of 4 bytes, got {len(data)}")
    values: list[float] = np.frombuffer(data, dtype="<f4").astype(np.float64).tolist()
    return values
