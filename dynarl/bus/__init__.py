"""The message bus: typed messages, ZeroMQ and in-process transports, user declarations.

- messages: one tagged ``msgspec`` union per channel (:data:`ControlMessage`,
  :data:`DataMessage`, :data:`EventMessage`), MessagePack on the wire (``docs/wire.md``);
- :class:`BusServer` / :class:`BusClient`: request/reply with request ids, deadlines,
  cancellation, registration and heartbeats (ROUTER/DEALER, or ``mem://`` in-process);
- :class:`Publisher` / :class:`Subscriber`: events and metrics by topic (PUB/SUB);
- :class:`WorkerGroup` and :class:`Channel`: what user components derive and call;
- :func:`run`, :func:`new_event_loop`, :class:`SyncBridge`: the loop (uvloop when
  installed) and the one bridge for blocking callers;
- CURVE key files and allow-lists for routable binds.
"""

from __future__ import annotations

from dynarl.bus.channel import Channel, ChannelBackend, ChannelTable
from dynarl.bus.client import BusClient
from dynarl.bus.codec import FrameCodec, Kind, MessageCodec
from dynarl.bus.component import GroupSpec, WorkerGroup
from dynarl.bus.config import BusConfig
from dynarl.bus.curve import (
    CurveClient,
    CurveServer,
    generate_keys,
    load_public_key,
    load_secret_key,
)
from dynarl.bus.endpoint import Handler
from dynarl.bus.loop import SyncBridge, loop_name, new_event_loop, run
from dynarl.bus.messages import (
    Ack,
    ChannelGet,
    ChannelItem,
    ChannelPut,
    ControlMessage,
    DataItem,
    DataMessage,
    Envelope,
    ErrorReply,
    EventMessage,
    GenerationRequest,
    Heartbeat,
    Interrupt,
    Message,
    MetaValue,
    MigrationAbort,
    MigrationCommit,
    MigrationPrepare,
    MigrationTransfer,
    PeerEvent,
    Ping,
    Pong,
    Register,
    Sample,
    Unregister,
    Welcome,
    pack_tokens,
    unpack_tokens,
)
from dynarl.bus.peers import Peer
from dynarl.bus.pubsub import Publisher, Subscriber
from dynarl.bus.records import (
    ComponentReport,
    DecisionRecord,
    MigrationRecord,
    RejectedCandidate,
    WorkerMetrics,
)
from dynarl.bus.server import BusServer
from dynarl.bus.stats import BusStats

__all__ = [
    "Ack",
    "BusClient",
    "BusConfig",
    "BusServer",
    "BusStats",
    "Channel",
    "ChannelBackend",
    "ChannelGet",
    "ChannelItem",
    "ChannelPut",
    "ChannelTable",
    "ComponentReport",
    "ControlMessage",
    "CurveClient",
    "CurveServer",
    "DataItem",
    "DataMessage",
    "DecisionRecord",
    "Envelope",
    "ErrorReply",
    "EventMessage",
    "FrameCodec",
    "GenerationRequest",
    "GroupSpec",
    "Handler",
    "Heartbeat",
    "Interrupt",
    "Kind",
    "Message",
    "MessageCodec",
    "MetaValue",
    "MigrationAbort",
    "MigrationCommit",
    "MigrationPrepare",
    "MigrationRecord",
    "MigrationTransfer",
    "Peer",
    "PeerEvent",
    "Ping",
    "Pong",
    "Publisher",
    "Register",
    "RejectedCandidate",
    "Sample",
    "Subscriber",
    "SyncBridge",
    "Unregister",
    "Welcome",
    "WorkerGroup",
    "WorkerMetrics",
    "generate_keys",
    "load_public_key",
    "load_secret_key",
    "loop_name",
    "new_event_loop",
    "pack_tokens",
    "run",
    "unpack_tokens",
]
