"""The runtime's worker protocol: what the controller and group managers ask of workers.

Every message travels inside a bus :class:`~dynarl.bus.Envelope` whose ``protocol`` is
:data:`PROTOCOL`; the body is one tagged MessagePack map of :data:`RuntimeMessage`
(``msgspec.Struct``, ``tag=True, frozen=True, kw_only=True``, like the bus's own).
Requests and their replies:

- :class:`Activate` → :class:`RoleStatus`: host a role instance (create it, or wake it)
  and make it the worker's active role;
- :class:`Deactivate` → :class:`RoleStatus`: put a role to sleep with its state, or tear
  it down;
- :class:`Call` → :class:`CallResult`: run a public method of a hosted role;
- :class:`AbortInflight` → :class:`Done`: make the active serving role return every
  in-flight item early (with its partial output);
- :class:`Reshard` → :class:`StepResult`: one step of a P2P reshard on this rank;
- :class:`SaveState` / :class:`LoadState` → :class:`Done`: a reboot's checkpoint;
- :class:`Shutdown` → :class:`Done`: leave the job.

Serving itself uses the bus's own data messages: a ``GenerationRequest`` (or ``Sample``)
request to a worker is answered with the ``Sample`` its active role produced. A partial
output says so in its metadata (:data:`FINISH`). Pure data; runs anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

from dynarl.bus import Envelope, MessageCodec, MetaValue, Sample
from dynarl.errors import ProtocolError

__all__ = [
    "FINISH",
    "PROMPT_LEN",
    "PROTOCOL",
    "RESUMED",
    "VERSIONS",
    "AbortInflight",
    "Activate",
    "Call",
    "CallResult",
    "Deactivate",
    "Done",
    "LoadState",
    "Reshard",
    "RoleStatus",
    "RuntimeMessage",
    "SaveState",
    "Shutdown",
    "StepResult",
    "decode_versions",
    "encode_versions",
    "pack",
    "unpack",
]

PROTOCOL: Final = "dynarl.runtime/1"
"""The ``Envelope.protocol`` of this protocol."""
FINISH: Final = "finish"
"""Sample metadata key: ``"stop"``, ``"length"`` or ``"abort"`` (a partial output)."""
PROMPT_LEN: Final = "prompt_len"
"""Request metadata key: prompt length of the original request (positions stay absolute
when an aborted generation is resumed with its partial output appended to the prompt)."""
RESUMED: Final = "resumed"
"""Sample metadata key: how many times its generation was aborted and resumed."""
VERSIONS: Final = "versions"
"""Sample metadata key: the weight version of every generated token, run-length encoded
(:func:`encode_versions`); the dispatcher joins those of a generation's partial outputs,
so a request aborted and resumed across a weight sync shows both versions."""


def encode_versions(versions: Sequence[int]) -> str:
    """``[3, 3, 4]`` as ``"3*2,4*1"`` (empty for no tokens)."""
    runs: list[list[int]] = []
    for version in versions:
        if runs and runs[-1][0] == version:
            runs[-1][1] += 1
        else:
            runs.append([int(version), 1])
    return ",".join(f"{v}*{n}" for v, n in runs)


def decode_versions(text: str) -> list[int]:
    """The per-token versions of :func:`encode_versions` text; ValueError if malformed."""
    out: list[int] = []
    for run in filter(None, text.split(",")):
        version, sep, count = run.partition("*")
        if not sep or not count.isdigit():
            raise ValueError(f"bad version run {run!r} in {text!r}")
        out += [int(version)] * int(count)
    return out


def stale_tokens(sample: Sample, version: int) -> int:
    """Generated tokens of ``sample`` sampled under another weight version than ``version``,
    or with none recorded (its :data:`VERSIONS` hold one version per generated token, as
    its ``logprobs`` hold one log-prob): 0 for an on-policy sample of ``version``. Raises
    ValueError for malformed versions."""
    text = sample.metadata.get(VERSIONS)
    versions = decode_versions(text) if isinstance(text, str) else []
    generated = len(sample.logprobs) // 4  # float32 each
    return sum(v != version for v in versions) + abs(generated - len(versions))


class Activate(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Host ``component``'s role on this worker and make it the active role."""

    component: str
    """Component name."""
    role: str
    """Import path of the role's class, ``"package.module:Class"``."""
    devices: tuple[int, ...]
    """Devices the component holds once this worker is active in it."""
    options: dict[str, MetaValue] = {}
    """The component's options (what its spec declares)."""
    manager: str = ""
    """Address of the component's manager endpoint (metrics go there); empty: none."""
    epoch: int = 0
    """Layout epoch for the groups a fresh role builds."""
    fresh: bool = True
    """Call the role's ``start()`` when it is created (False: it joins by migration)."""


class Deactivate(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Stop ``component``'s role on this worker: asleep with its state, or torn down."""

    component: str
    """Component name."""
    keep: bool = True
    """Keep the instance asleep (True) or tear it down (False)."""


class RoleStatus(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """What a worker hosts after an ``Activate`` or ``Deactivate``."""

    device: int
    """The worker's device."""
    active: str = ""
    """The active component, or empty."""
    asleep: tuple[str, ...] = ()
    """Components whose role sleeps here with its state, sorted."""


class Call(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Run ``method(samples, **options)`` of ``component``'s role on this worker."""

    component: str
    """Component name."""
    method: str
    """A public method of the role's class."""
    samples: tuple[Sample, ...] = ()
    """Samples passed as the first argument."""
    options: dict[str, MetaValue] = {}
    """Keyword arguments."""


class CallResult(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """What one worker's method returned."""

    device: int
    """The worker's device."""
    values: dict[str, MetaValue] = {}
    """Scalar results."""
    samples: tuple[Sample, ...] = ()
    """Samples returned, if any."""


class AbortInflight(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Make the serving role of ``component`` return every in-flight item now."""

    component: str
    """Component name."""


class Reshard(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One step of P2P migration ``migration_id`` on this rank.

    ``prepare`` creates the rank's migration (and, on a joining rank, the role instance);
    ``transfer``, ``verify``, ``commit``, ``abort``, ``rollback`` and ``close`` then
    drive it. Repeating a step answers from the migration's log.
    """

    migration_id: str
    """The migration."""
    step: str
    """``prepare``, ``transfer``, ``verify``, ``commit``, ``abort``, ``rollback`` or ``close``."""
    component: str = ""
    """Component whose state moves (prepare)."""
    role: str = ""
    """Import path of the role's class (prepare, on a joining rank)."""
    options: dict[str, MetaValue] = {}
    """The component's options (prepare, on a joining rank)."""
    manager: str = ""
    """Address of the component's manager endpoint (prepare, on a joining rank)."""
    src: tuple[int, ...] = ()
    """Devices holding the state now (prepare)."""
    dst: tuple[int, ...] = ()
    """Devices holding it after commit (prepare)."""
    epoch: int = 0
    """Epoch naming the new layout's groups (prepare)."""
    lease_s: float = 60.0
    """Seconds from prepare until this rank refuses forward steps and rolls back itself."""


class StepResult(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The outcome of one reshard step on one rank."""

    device: int
    """The rank's device."""
    ok: bool
    """Whether the step succeeded."""
    detail: str = ""
    """Why it failed; empty on success."""
    bytes_moved: int = 0
    """Bytes this rank sent to other ranks (transfer)."""
    seconds: float = 0.0
    """Time the step took on this rank."""


class SaveState(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Write ``component``'s state on this worker under directory ``path``."""

    component: str
    """Component name."""
    path: str
    """Checkpoint directory (shared by the component's workers)."""


class LoadState(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Restore ``component``'s state on this worker from directory ``path``."""

    component: str
    """Component name."""
    path: str
    """Checkpoint directory written by ``SaveState``."""


class Shutdown(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Tear every role down and leave the job."""

    reason: str = ""
    """Why (informative)."""


class Done(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Positive reply carrying no data."""

    detail: str = ""
    """Optional detail (informative)."""


RuntimeMessage = (
    Activate
    | Deactivate
    | RoleStatus
    | Call
    | CallResult
    | AbortInflight
    | Reshard
    | StepResult
    | SaveState
    | LoadState
    | Shutdown
    | Done
)
"""Every message of the runtime protocol."""

_CODEC: MessageCodec[RuntimeMessage] = MessageCodec(RuntimeMessage, 1 << 30)


def pack(message: RuntimeMessage) -> Envelope:
    """``message`` in its bus envelope."""
    return Envelope(protocol=PROTOCOL, body=_CODEC.encode(message))


def unpack(envelope: object) -> RuntimeMessage:
    """The runtime message inside ``envelope``.

    Raises ProtocolError when it is not an ``Envelope`` of :data:`PROTOCOL` or its body
    is not a runtime message.
    """
    if not isinstance(envelope, Envelope):
        raise ProtocolError(f"invalid: expected an Envelope, got {type(envelope).__name__}")
    if envelope.protocol != PROTOCOL:
        raise ProtocolError(f"invalid: protocol {envelope.protocol!r}, expected {PROTOCOL!r}")
    return _CODEC.decode(envelope.body)
