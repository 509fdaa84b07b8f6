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

from dynarl.bus._bus_config import BusConfig
from dynarl.bus._channel import Channel, ChannelBackend
from dynarl.bus._client import BusClient
from dynarl.bus._codec import MessageCodec
from dynarl.bus._component import WorkerGroup
from dynarl.bus._curve import (
    CurveClient,
    CurveServer,
    generate_keys,
    load_public_key,
    load_secret_key,
)
from dynarl.bus._loop import run
from dynarl.bus._messages import (
    Envelope,
    GenerationRequest,
    Interrupt,
    MetaValue,
    PeerEvent,
    Sample,
    pack_tokens,
    unpack_tokens,
)
from dynarl.bus._peers import Peer
from dynarl.bus._pubsub import Publisher
from dynarl.bus._report_records import (
    ComponentReport,
    DecisionRecord,
    MigrationRecord,
    RejectedCandidate,
    WorkerMetrics,
)
from dynarl.bus._server import BusServer

__all__ = [
    "BusClient",
    "BusConfig",
    "BusServer",
    "Channel",
    "ChannelBackend",
    "ComponentReport",
    "CurveClient",
    "CurveServer",
    "DecisionRecord",
    "Envelope",
    "GenerationRequest",
    "Interrupt",
    "MessageCodec",
    "MetaValue",
    "MigrationRecord",
    "Peer",
    "PeerEvent",
    "Publisher",
    "RejectedCandidate",
    "Sample",
    "WorkerGroup",
    "WorkerMetrics",
    "generate_keys",
    "load_public_key",
    "load_secret_key",
    "pack_tokens",
    "run",
    "unpack_tokens",
]
