"""The one exception tree of dynarl.

Every error dynarl raises on purpose derives from :class:`DynarlError`; bad user input
raises :class:`ValueError` (or :class:`TypeError`) instead, at the call that received it —
a bad config value as :class:`ConfigValueError`, a ``ValueError`` that keeps the keys it
names apart from its text.

::

    DynarlError
     ├── BusError                  the message bus could not carry a message
     │    ├── ProtocolError        a frame broke the wire protocol (bad bytes, tag, version, size)
     │    ├── PeerLostError        a peer stopped answering heartbeats
     │    ├── DeadlineExceeded     a request's deadline passed (also a TimeoutError)
     │    └── RemoteError          the peer answered with an error reply
     ├── SchedulingError           the decision plane could not produce a valid plan
     ├── MigrationError            a migration failed; the previous allocation stays in force
     │    ├── LeaseExpiredError    a migration's lease lapsed before commit
     │    └── MigrationAborted     a migration was aborted on purpose (operator, safe mode)
     ├── WorkerError               a worker or worker group failed outside a migration
     │    └── WorkerLostError      a worker process died outside a migration
     ├── IntegrityError            durable state on disk (journal, checkpoint) failed verification
     └── BackendError              an engine or trainer backend (SGLang, Megatron) misbehaved
          └── EngineLostError      a role's engine process died: its worker leaves the job
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BusError",
    "ConfigValueError",
    "DeadlineExceeded",
    "DynarlError",
    "EngineLostError",
    "IntegrityError",
    "LeaseExpiredError",
    "MigrationAborted",
    "MigrationError",
    "PeerLostError",
    "ProtocolError",
    "RemoteError",
    "SchedulingError",
    "WorkerError",
    "WorkerLostError",
]


class DynarlError(Exception):
    """Base class of every error dynarl raises on purpose."""


class BusError(DynarlError):
    """The message bus could not carry a message."""


class ProtocolError(BusError):
    """A frame or message broke the wire protocol.

    Raised by decoders for malformed MessagePack, unknown tags, unsupported protocol
    versions, wrong frame counts and oversize messages. The message says what was wrong.
    """


class PeerLostError(BusError):
    """A peer stopped answering heartbeats; requests waiting on it fail with this."""

    def __init__(self, peer: str, message: str | None = None) -> None:
        super().__init__(message or f"peer {peer!r} was lost (missed heartbeats)")
        self.peer = peer


class DeadlineExceeded(BusError, TimeoutError):
    """A request's deadline passed before its reply arrived."""


class RemoteError(BusError):
    """The peer received the request but answered with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.remote_message = message


class SchedulingError(DynarlError):
    """The decision plane could not produce a valid plan."""


class MigrationError(DynarlError):
    """A migration failed; the previous allocation stays in force."""


class LeaseExpiredError(MigrationError):
    """A migration's lease lapsed before it committed."""


class MigrationAborted(MigrationError):
    """A migration was aborted on purpose (operator command, safe mode, newer plan)."""


class WorkerError(DynarlError):
    """A worker or worker group failed outside a migration."""


class WorkerLostError(WorkerError):
    """A worker process died outside a migration (killed, out of memory, its host gone).

    ``component`` is what the worker hosted ("" for none), ``worker`` its bus name,
    ``device`` its device, ``cause`` how it ended (``"killed by SIGKILL"``, ``"exited with
    status 1"``, ``"missed heartbeats"``). ``fatal`` says the job cannot go on: every
    call, submission and output of the job then raises it.
    """

    def __init__(
        self, message: str, *, component: str, device: int, cause: str, fatal: bool
    ) -> None:
        super().__init__(message)
        self.component = component
        self.device = device
        self.worker = f"worker/{device}"
        self.cause = cause
        self.fatal = fatal


class IntegrityError(DynarlError):
    """Durable state on disk failed verification: a checkpoint's checksums, or a journal
    damaged before its last record (a torn last record is expected after a crash and is
    not an error)."""


class BackendError(DynarlError):
    """An engine or trainer backend (SGLang, Megatron) misbehaved."""


class EngineLostError(BackendError):
    """The engine process a role drives died (killed, crashed, out of memory).

    A role raises it from ``serve`` or ``run``; the worker hosting the role then leaves the
    job, which treats its device as lost (the in-flight work continues on other workers,
    the device is reclaimed), since a worker without its engine can serve nothing.
    """


class ConfigValueError(ValueError):
    """A bad config value (a ``ValueError``, not a :class:`DynarlError`: bad input).

    A config dataclass (``dynarl.sched.SchedulerConfig``, the simulator's workload tables)
    raises it from ``__post_init__``. Built from Python, the message names each key after
    its class (``StageSpec.min_gpus = 6``); a file reader re-names them as its file spells
    them (``[trainer] min_gpus = 6``) with :meth:`naming`, without parsing the message back.

    ``rule`` is a :meth:`str.format` template with one ``{key}`` field per key involved;
    ``values`` holds each key's value. Each field renders as ``<owner>key = value``.
    """

    def __init__(self, owner: str, rule: str, **values: object) -> None:
        self.rule = rule
        self.values = values
        super().__init__(self.naming(owner))

    def naming(self, owner: str) -> str:
        """The message with every key prefixed by ``owner`` (``"[trainer] "``, ``"StageSpec."``)."""
        return self.rule.format(**{k: f"{owner}{k} = {v!r}" for k, v in self.values.items()})
