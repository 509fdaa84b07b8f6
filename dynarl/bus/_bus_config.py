"""Settings of the message bus: heartbeats, deadlines, size limits, queue bounds.

One :class:`BusConfig` is shared by a server and its clients (the server also announces its
heartbeat settings and size limit in the ``Welcome`` reply, so a client adopts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BusConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BusConfig:
    """Settings of one bus endpoint (server, client, publisher or subscriber)."""

    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats; a peer is checked for loss four times per interval."""
    num_missed_heartbeats: int = 3
    """Heartbeat intervals a peer may stay silent before it is declared lost.

    Waiters on a lost peer fail with ``PeerLostError`` within
    ``(num_missed_heartbeats + 1) * heartbeat_interval_s`` of its last frame.
    """
    max_message_bytes: int = 16 * 1024 * 1024
    """Largest frame accepted or sent. Larger frames up to twice this are refused with an
    error reply; ZeroMQ itself drops the connection of a peer sending more than twice this
    (its ``MAXMSGSIZE``)."""
    default_timeout_s: float = 30.0
    """Deadline of a request that does not give one, seconds."""
    register_timeout_s: float = 10.0
    """Deadline of the registration handshake, seconds."""
    send_hwm: int = 100_000
    """ZeroMQ send high-water mark (messages queued per peer before sends are refused)."""
    recv_hwm: int = 100_000
    """ZeroMQ receive high-water mark (messages queued per peer before reading stalls)."""
    log_interval_s: float = 10.0
    """Bad frames of one kind are logged at most once per this many seconds (with a count)."""
    channel_capacity: int = 64
    """Default number of items one channel key holds before ``put`` blocks."""

    def __post_init__(self) -> None:
        positive = {
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "default_timeout_s": self.default_timeout_s,
            "register_timeout_s": self.register_timeout_s,
            "log_interval_s": self.log_interval_s,
        }
        for name, value in positive.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"BusConfig.{name} must be a positive finite number, got {value!r}"
                )
        counts = {
            "num_missed_heartbeats": (self.num_missed_heartbeats, 1),
            "max_message_bytes": (self.max_message_bytes, 256),
            "send_hwm": (self.send_hwm, 1),
            "recv_hwm": (self.recv_hwm, 1),
            "channel_capacity": (self.channel_capacity, 1),
        }
        for name, (count, least) in counts.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < least:
                raise ValueError(f"BusConfig.{name} must be an int >= {least}, got {count!r}")
        if self.max_message_bytes > 1 << 30:
            raise ValueError(
                f"BusConfig.max_message_bytes must be at most 1 GiB, got {self.max_message_bytes}"
            )

    @property
    def loss_after_s(self) -> float:
        """Silence, in seconds, after which a peer is declared lost."""
        return self.num_missed_heartbeats * self.heartbeat_interval_s

    @property
    def check_interval_s(self) -> float:
        """How often peers are checked for loss, seconds."""
        return self.heartbeat_interval_s / 4

    @property
    def zmq_max_message_bytes(self) -> int:
        """ZeroMQ's ``MAXMSGSIZE``: frames beyond it cost the sender its connection."""
        return 2 * self.max_message_bytes
