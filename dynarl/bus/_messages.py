"""Typed wire messages, one tagged union per channel.

Every message is a ``msgspec.Struct`` with ``tag=True`` (the tag is the class name, carried
in the ``"type"`` field of a MessagePack map), ``frozen=True`` and ``kw_only=True``.

- :data:`ControlMessage`: registration, heartbeats, metrics reports, interrupts, migration
  phases and their acknowledgements or errors (request/reply socket);
- :data:`DataMessage`: samples, generation requests and channel operations (request/reply
  socket);
- :data:`EventMessage`: ledger records, reports and peer events (publish/subscribe socket).

``docs/wire.md`` documents every field for clients written in other languages.
"""

from __future__ import annotations

from typing import Final, get_args

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


# ----------------------------------------------------------------------------- control


class Register(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """First request of every client: who it is and which protocol it speaks."""

    protocol: int
    """Wire protocol version the client speaks; refused unless the server supports it."""
    name: str
    """Unique peer name on this server (for instance ``"rollout/3"``)."""
    role: str = ""
    """Free-form role of the process (``"worker"``, ``"manager"``, ...)."""
    component: str = ""
    """Logical component the peer belongs to, if any."""
    worker: int = -1
    """Worker index within the component, or -1."""
    pid: int = 0
    """Operating-system process id of the peer (informative)."""
    host: str = ""
    """Host name of the peer (informative)."""
    devices: tuple[int, ...] = ()
    """Device ids the peer holds."""


class Welcome(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Reply to ``Register``: the server's protocol version and the settings to adopt."""

    protocol: int
    """Wire protocol version of the server."""
    server: str
    """Name of the server."""
    peer: str
    """The name the peer was registered under."""
    heartbeat_interval_s: float
    """Seconds between heartbeats the client must send."""
    num_missed_heartbeats: int
    """Silent intervals after which either side declares the other lost."""
    max_message_bytes: int
    """Largest frame the server accepts."""


class Unregister(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Notification that the sender is leaving; its pending requests fail at once."""

    reason: str = ""
    """Why it leaves (informative)."""


class Heartbeat(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Liveness notification; a server echoes each one back to its sender."""

    seq: int
    """Sender's heartbeat counter."""
    time: float = 0.0
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

    component: str
    """Component to interrupt."""
    reason: str = ""
    """Why (informative: a migration id, an operator command)."""


class MigrationPrepare(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Phase 1 of a migration: reserve resources and stage what the move needs."""

    migration_id: str
    """Unique id of the migration; every phase is idempotent per id."""
    decision_id: str
    """Decision that caused the migration."""
    kind: str
    """A ``dynarl.MigrationKind`` value."""
    component: str
    """Component whose state moves."""
    src_devices: tuple[int, ...]
    """Devices the component holds now."""
    dst_devices: tuple[int, ...]
    """Devices it will hold after commit."""
    lease_deadline: float
    """Wall-clock time (UNIX seconds) after which the receiver aborts the migration itself."""


class MigrationTransfer(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Phase 2: move the state (p2p tensors, re-dispatched requests)."""

    migration_id: str
    """The migration."""
    lease_deadline: float
    """Wall-clock time (UNIX seconds) by which the transfer must finish."""


class MigrationCommit(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Phase 3: switch to the new resources and free the old ones."""

    migration_id: str
    """The migration."""
    lease_deadline: float
    """Wall-clock time (UNIX seconds) by which the commit must finish."""


class MigrationAbort(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Abandon a migration and roll back to the previous resources."""

    migration_id: str
    """The migration."""
    reason: str = ""
    """Why it is aborted."""


class Ack(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Positive reply carrying no data."""

    detail: str = ""
    """Optional detail (informative)."""


class ErrorReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Negative reply: the request (or a frame) was refused or failed."""

    code: str
    """Machine-readable reason (``docs/wire.md`` lists them)."""
    message: str
    """What was wrong, for humans."""


class Envelope(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A message of a protocol layered on the bus (the runtime's worker protocol).

    The bus carries it as it is; the layer named by ``protocol`` decodes ``body`` with its
    own typed decoder. A request's reply is another ``Envelope`` (or ``Ack``/``ErrorReply``).
    """

    protocol: str
    """Name and version of the inner protocol (for instance ``"dynarl.runtime/1"``)."""
    body: bytes
    """The inner message: one tagged MessagePack map of that protocol."""


# ----------------------------------------------------------------------------- data


class Sample(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One trajectory: prompt and response tokens with its reward."""

    sample_id: str
    """Unique, stable id (the trainer's manifests list these)."""
    token_ids: bytes
    """Prompt then response token ids, packed little-endian int32 (:func:`pack_tokens`)."""
    prompt_len: int
    """Number of prompt tokens at the front of ``token_ids``."""
    prompt_id: str = ""
    """Id of the prompt (samples of one GRPO group share it)."""
    reward: float | None = None
    """Reward, once known."""
    logprobs: bytes = b""
    """Per-response-token log-probabilities, packed little-endian float32, or empty."""
    policy_version: int = 0
    """Version of the policy weights that generated the response."""
    metadata: dict[str, MetaValue] = {}
    """Free-form scalar metadata (task id, turn, tool calls, ...)."""


class GenerationRequest(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Ask a rollout engine to continue a prompt."""

    sample_id: str
    """Id the resulting ``Sample`` will carry."""
    token_ids: bytes
    """Prompt token ids, packed little-endian int32."""
    max_new_tokens: int
    """Upper bound on generated tokens."""
    prompt_id: str = ""
    """Id of the prompt (group)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    seed: int | None = None
    """Sampling seed (deterministic mode keys randomness by seed, sample id and position)."""
    priority: int = 0
    """Scheduling priority; higher runs first."""
    metadata: dict[str, MetaValue] = {}
    """Free-form scalar metadata."""


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
    capacity: int
    """Bound of the queue if this call creates it (an existing queue keeps its bound)."""


class ChannelGet(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Take the oldest item of ``(channel, key)``; the ``ChannelItem`` reply waits for one."""

    channel: str
    """Channel name."""
    key: str
    """Queue key within the channel."""
    capacity: int
    """Bound of the queue if this call creates it (an existing queue keeps its bound)."""


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

    peer: str
    """Peer name."""
    event: str
    """``"registered"``, ``"left"`` or ``"lost"``."""
    time: float
    """Wall-clock time (UNIX seconds)."""
    role: str = ""
    """The peer's declared role."""


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
