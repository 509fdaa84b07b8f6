"""Peers of an endpoint and the rule that declares one lost.

A peer is *lost* once it has been silent (no frame of any kind) for longer than
``BusConfig.loss_after_s`` = ``num_missed_heartbeats × heartbeat_interval_s``. Endpoints
check every ``heartbeat_interval_s / 4``, and a live peer sends at least one frame per
interval, so a peer that dies is declared lost — and every request waiting on it fails
with ``PeerLostError`` — within ``(num_missed_heartbeats + 1) × heartbeat_interval_s`` of
its death.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from dynarl.bus._messages import Register

__all__ = ["Peer", "PeerTable", "overdue"]


@dataclass(eq=False, slots=True)
class Peer:
    """One peer as seen by an endpoint (mutated only on the endpoint's loop)."""

    name: str
    """Registered name (a client calls its server by the server's name)."""
    key: bytes
    """Routing id of the peer's connection (empty for a client's server)."""
    last_seen: float
    """Loop time the last frame from this peer arrived."""
    info: Register | None = None
    """What the peer declared when it registered (None for a client's server)."""
    lost: bool = False
    """Whether the peer was lost or left; nothing is sent to it any more."""
    running: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    """Handler tasks serving this peer's requests, by request id."""

    @property
    def role(self) -> str:
        """The role the peer declared ("" if unknown)."""
        return self.info.role if self.info is not None else ""


def overdue(peers: Iterable[Peer], now: float, loss_after_s: float) -> list[Peer]:
    """Peers silent for more than ``loss_after_s`` at loop time ``now`` (pure)."""
    return [peer for peer in peers if now - peer.last_seen > loss_after_s]


class PeerTable:
    """The registered peers of a server, by routing id and by name."""

    def __init__(self) -> None:
        self._by_key: dict[bytes, Peer] = {}
        self._by_name: dict[str, Peer] = {}
        self.get = self._by_key.get

    def add(self, peer: Peer) -> Peer | None:
        """Register ``peer``; returns the peer it displaces (same name, other connection)."""
        old = self._by_name.get(peer.name)
        if old is not None:
            self._by_key.pop(old.key, None)
        stale = self._by_key.get(peer.key)
        if stale is not None and stale is not old:
            self._by_name.pop(stale.name, None)
        self._by_key[peer.key] = peer
        self._by_name[peer.name] = peer
        return old if old is not None and old is not peer else None

    def remove(self, peer: Peer) -> None:
        """Forget ``peer`` (if it is still the one registered under its key and name)."""
        if self._by_key.get(peer.key) is peer:
            del self._by_key[peer.key]
        if self._by_name.get(peer.name) is peer:
            del self._by_name[peer.name]

    def named(self, name: str) -> Peer | None:
        """The peer registered under ``name``, if any."""
        return self._by_name.get(name)

    def names(self) -> list[str]:
        """Names of the registered peers, sorted."""
        return sorted(self._by_name)

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._by_key.values()))

    def __len__(self) -> int:
        return len(self._by_key)
