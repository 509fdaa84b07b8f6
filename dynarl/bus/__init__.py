"""The message bus: typed messages, ZeroMQ and in-process transports, user declarations.

- messages: one tagged ``msgspec`` union per channel (:data:`ControlMessage`,
  :data:`DataMessage`, :data:`EventMessage`), MessagePack on the wire (``docs/wire.md``);
- :class:`BusServer` / :class:`BusClient`: request/reply with request ids, deadlines,
  cancellation, registration and heartbeats (ROUTER/DEALER, or ``mem://`` in-process);
- :class:`Publisher` / :class:`Subscriber`: events and metrics by topic (PUB/SUB);
- :class:`WorkerGroup` and :class:`Channel`: what user components derive and call;
- decision reasons: one tagged struct per reason (:data:`DecisionReason`,
  :data:`CandidateReason`), carried by :class:`DecisionRecord`;
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
from dynarl.bus._decision_reasons import (
    CandidateReason,
    Commit,
    DecisionReason,
    FinishesLater,
    HoldReason,
    InfeasiblePlacement,
    LegacyReason,
    MinimumInterval,
    MoveInFlight,
    NoDonor,
    NoFeasibleReduction,
    NoMovableDonor,
    NotBetterAfterCost,
    ObserveOnly,
    QuotaRefused,
    Reclaim,
    Rejected,
    RejectionReason,
    SafeMode,
    SavesLess,
)
from dynarl.bus._loop import run
from dynarl.bus._messages import (
    Envelope,
    GenerationRequest,
    Interrupt,
    MetaValue,
    PeerEvent,
    Sample,
    pack_floats,
    pack_tokens,
    unpack_floats,
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
    "CandidateReason",
    "Channel",
    "ChannelBackend",
    "Commit",
    "ComponentReport",
    "CurveClient",
    "CurveServer",
    "DecisionReason",
    "DecisionRecord",
    "Envelope",
    "FinishesLater",
    "GenerationRequest",
    "HoldReason",
    "InfeasiblePlacement",
    "Interrupt",
    "LegacyReason",
    "MessageCodec",
    "MetaValue",
    "MigrationRecord",
    "MinimumInterval",
    "MoveInFlight",
    "NoDonor",
    "NoFeasibleReduction",
    "NoMovableDonor",
    "NotBetterAfterCost",
    "ObserveOnly",
    "Peer",
    "PeerEvent",
    "Publisher",
    "QuotaRefused",
    "Reclaim",
    "Rejected",
    "RejectedCandidate",
    "RejectionReason",
    "SafeMode",
    "Sample",
    "SavesLess",
    "WorkerGroup",
    "WorkerMetrics",
    "generate_keys",
    "load_public_key",
    "load_secret_key",
    "pack_floats",
    "pack_tokens",
    "run",
    "unpack_floats",
    "unpack_tokens",
]
