"""Counters of a bus endpoint, its error codes, and rate-limited logging of bad input.

Every refused frame is counted under one reason (the same string as the ``code`` of the
error reply sent back, see ``docs/wire.md``) and logged at most once per
``BusConfig.log_interval_s`` per reason, with the number of occurrences since the last line,
so a peer flooding garbage cannot flood the log.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dynarl.bus._messages import ErrorReply
from dynarl.errors import BusError, DeadlineExceeded, ProtocolError, RemoteError

__all__ = ["BAD_FRAME_REASONS", "BusStats", "RateLimitedLog", "error_code", "error_from_reply"]

BAD_FRAME_REASONS = (
    "frame_count",
    "oversize",
    "malformed",
    "unknown_kind",
    "unknown_tag",
    "invalid",
    "protocol_version",
    "not_registered",
    "no_handler",
)
"""Reasons a received frame is refused; each is also the ``code`` of the error reply."""


def error_from_reply(reply: ErrorReply) -> BusError:
    """The exception a requester raises for an error reply (``docs/wire.md`` §7)."""
    if reply.code in BAD_FRAME_REASONS:
        return ProtocolError(f"{reply.code}: {reply.message}")
    if reply.code == "deadline_exceeded":
        return DeadlineExceeded(reply.message)
    return RemoteError(reply.code, reply.message)


def error_code(exc: BaseException) -> str:
    """The error reply code for an exception a handler raised."""
    if isinstance(exc, ValueError | TypeError):
        return "bad_request"
    if isinstance(exc, DeadlineExceeded):
        return "deadline_exceeded"
    return "handler_error"


class RateLimitedLog:
    """Logs a warning per reason at most once per interval, counting what it held back.

    Runs on the endpoint's event loop (not thread-safe).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def warning(self, reason: str, message: str, *args: object) -> bool:
        """Log ``message % args`` under ``reason`` unless logged within the interval.

        Returns whether a line was written.
        """
        now = self._clock()
        last = self._last.get(reason)
        if last is not None and now - last < self._interval_s:
            self._held[reason] += 1
            return False
        held = self._held.pop(reason, 0)
        self._last[reason] = now
        if held:
            assert last is not None  # something was held back, so a line was written before
            text = message % args
            self._logger.warning(
                "%s (and %d more like it in the last %.0f s)", text, held, now - last
            )
        else:
            self._logger.warning(message, *args)
        return True


@dataclass(slots=True)
class BusStats:
    """What one endpoint has carried and refused since it started (its event loop only)."""

    frames_in: int = 0
    """Frames received (including refused ones)."""
    frames_out: int = 0
    """Frames sent."""
    requests_in: int = 0
    """Requests received and dispatched to a handler."""
    requests_out: int = 0
    """Requests sent."""
    replies_dropped: int = 0
    """Replies or notifications that could not be sent (peer gone or its queue full)."""
    cancelled: int = 0
    """Requests whose handler was cancelled because the requester sent CANCEL."""
    stale_replies: int = 0
    """Replies that matched no waiting request (it had timed out, been cancelled or failed)."""
    handler_errors: int = 0
    """Requests whose handler raised."""
    peers_lost: int = 0
    """Peers declared lost after missed heartbeats."""
    bad_frames: Counter[str] = field(default_factory=Counter)
    """Refused frames by reason (see ``BAD_FRAME_REASONS``)."""

    @property
    def num_bad_frames(self) -> int:
        """Refused frames, all reasons together."""
        return sum(self.bad_frames.values())

    def snapshot(self) -> Mapping[str, int]:
        """A flat copy: the scalar counters and ``bad.<reason>`` for each reason seen."""
        flat = {
            "frames_in": self.frames_in,
            "frames_out": self.frames_out,
            "requests_in": self.requests_in,
            "requests_out": self.requests_out,
            "replies_dropped": self.replies_dropped,
            "cancelled": self.cancelled,
            "stale_replies": self.stale_replies,
            "handler_errors": self.handler_errors,
            "peers_lost": self.peers_lost,
        }
        flat.update({f"bad.{reason}": count for reason, count in self.bad_frames.items()})
        return flat
