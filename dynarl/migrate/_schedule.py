"""The message schedule of a plan: which bytes travel in which message, in which round.

Both ends of a pair compute the same schedule from the plan alone, so they agree on message
sizes and order without exchanging anything. An item travels as its own message ("direct")
when that saves copies worth at least ``direct_bytes``: one copy per end where its region is
contiguous in the shard that holds it (the executor then sends straight from the source
shard or receives straight into the destination shard, with no staging). Every message costs
a handshake, so smaller items, and items strided at both ends, are packed per peer, each
piece 8-byte aligned. Rounds carry at most ``chunk_bytes`` per peer and direction (this
bounds the staging memory); items larger than that are cut into element ranges.

Pure: no torch. Runs on every rank of a plan (its own pairs only).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from dynarl.migrate._region import Region, flat_range_boxes
from dynarl.migrate._reshard_plan import ReshardPlan, Transfer

__all__ = [
    "ALIGN",
    "Message",
    "Piece",
    "Schedule",
    "build_schedule",
    "contiguous_within",
    "piece_boxes",
]

ALIGN = 8
"""Byte alignment of every piece inside a packed message (any dtype views it in place)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, stop)`` (row-major) of ``item``, at ``offset`` of its message."""

    item: Transfer
    start: int
    stop: int
    offset: int
    nbytes: int


@dataclass(frozen=True, eq=False, slots=True)
class Message:
    """One isend/irecv: packed pieces of small items, or one piece of a direct item.

    ``src_contiguous``/``dst_contiguous`` say whether the pieces are contiguous in the
    shards that hold them (geometry only: the executor still checks the actual views).
    Compared and hashed by identity.
    """

    peer: int
    tag: int
    pieces: tuple[Piece, ...]
    direct: bool
    nbytes: int
    src_contiguous: bool
    dst_contiguous: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """One rank's messages: per peer, the rounds it sends and the rounds it receives."""

    sends: dict[int, tuple[tuple[Message, ...], ...]]
    """Peer -> rounds -> messages this rank sends to the peer."""
    recvs: dict[int, tuple[tuple[Message, ...], ...]]
    """Peer -> rounds -> messages this rank receives from the peer."""

    @property
    def num_rounds(self) -> int:
        """Rounds of the busiest pair (every rank of the plan runs that many)."""
        return max((len(r) for r in (*self.sends.values(), *self.recvs.values())), default=0)

    @property
    def num_messages(self) -> int:
        """Messages this rank sends or receives."""
        return sum(
            len(r) for rounds in (*self.sends.values(), *self.recvs.values()) for r in rounds
        )

    def round(self, index: int, *, outgoing: bool) -> list[Message]:
        """Messages of round ``index`` in one direction, the peers' first messages first
        (the order in which they are likely to complete); each peer's in schedule order."""
        table = self.sends if outgoing else self.recvs
        per_peer = [rounds[index] for rounds in table.values() if index < len(rounds)]
        depth = max((len(m) for m in per_peer), default=0)
        return [m[k] for k in range(depth) for m in per_peer if k < len(m)]


def contiguous_within(region: Region, outer: Region) -> bool:
    """Whether ``region`` is one contiguous run of ``outer``'s row-major elements.

    True when every dimension after the first one longer than 1 spans ``outer`` entirely.
    """
    sizes = region.sizes
    first = next((d for d, n in enumerate(sizes) if n > 1), len(sizes))
    return all(sizes[d] == outer.sizes[d] for d in range(first + 1, len(sizes)))


def piece_boxes(piece: Piece) -> list[Region]:
    """The piece's elements as boxes in global coordinates, in flat order."""
    region = piece.item.region
    return [
        Region(
            offsets=tuple(a + b for a, b in zip(region.offsets, box.offsets, strict=True)),
            sizes=box.sizes,
        )
        for box in flat_range_boxes(region.sizes, piece.start, piece.stop)
    ]


def build_schedule(
    plan: ReshardPlan, rank: int, *, chunk_bytes: int, direct_bytes: int
) -> Schedule:
    """The messages ``rank`` sends and receives to carry ``plan`` out.

    ``chunk_bytes`` (at least ``ALIGN``) bounds a round per peer and direction.
    """
    assert chunk_bytes >= ALIGN and direct_bytes >= 1
    holders = _holders(plan)
    sizes = _Sizes(
        itemsize={t.name: t.itemsize for t in plan.tensors},
        chunk=chunk_bytes,
        direct=direct_bytes,
    )
    sends: dict[int, list[Transfer]] = defaultdict(list)
    recvs: dict[int, list[Transfer]] = defaultdict(list)
    for item in plan.items:
        if item.is_local:
            continue
        if item.src_rank == rank:
            sends[item.dst_rank].append(item)
        elif item.dst_rank == rank:
            recvs[item.src_rank].append(item)

    def rounds(peer: int, items: list[Transfer]) -> tuple[tuple[Message, ...], ...]:
        flags = [_contiguity(holders, item) for item in items]
        return _rounds(_messages(peer, items, flags, sizes), sizes.chunk)

    return Schedule(
        sends={p: rounds(p, items) for p, items in sends.items()},
        recvs={p: rounds(p, items) for p, items in recvs.items()},
    )


@dataclass(frozen=True, slots=True)
class _Sizes:
    itemsize: dict[str, int]
    chunk: int
    direct: int


Holders = dict[tuple[bool, str, int], list[Region]]


def _holders(plan: ReshardPlan) -> Holders:
    """Shard regions by (is source, tensor, rank)."""
    out: Holders = defaultdict(list)
    for is_src, side in ((True, plan.src), (False, plan.dst)):
        for shard in side:
            out[is_src, shard.tensor, shard.rank].append(shard.region)
    return out


def _contiguity(holders: Holders, item: Transfer) -> tuple[bool, bool]:
    """Whether ``item`` is contiguous in its source shard, and in its destination shard
    (the shards of one side never overlap on a rank: exactly one contains the region)."""

    def within(is_src: bool, rank: int) -> bool:
        outers = holders[is_src, item.tensor, rank]
        return any(o.contains(item.region) and contiguous_within(item.region, o) for o in outers)

    return within(True, item.src_rank), within(False, item.dst_rank)


def _messages(
    peer: int, items: list[Transfer], flags: list[tuple[bool, bool]], sizes: _Sizes
) -> list[Message]:
    """Direct messages, then the packed ones; tags in that order."""
    direct: list[tuple[Piece, bool, bool]] = []
    packed: list[tuple[Transfer, bool, bool]] = []
    for item, (src_ok, dst_ok) in zip(items, flags, strict=True):
        size = sizes.itemsize[item.tensor]
        nbytes = item.region.numel * size
        saved = int(src_ok) + int(dst_ok)
        if not saved or nbytes * saved < sizes.direct:
            packed.append((item, src_ok, dst_ok))
            continue
        step = max(1, sizes.chunk // size)
        for start in range(0, item.region.numel, step):
            stop = min(item.region.numel, start + step)
            direct.append((Piece(item, start, stop, 0, (stop - start) * size), src_ok, dst_ok))
    out = [
        Message(peer, 0, (p,), True, p.nbytes, src_contiguous=s, dst_contiguous=d)
        for p, s, d in direct
    ]
    out += _pack(peer, packed, sizes)
    return [_with_tag(m, tag) for tag, m in enumerate(out)]


def _pack(peer: int, items: list[tuple[Transfer, bool, bool]], sizes: _Sizes) -> list[Message]:
    """Pack items into messages of at most ``sizes.chunk`` bytes, splitting items as needed."""
    out: list[Message] = []
    pieces: list[Piece] = []
    used = 0
    for item, _, _ in items:
        size = sizes.itemsize[item.tensor]
        numel, done = item.region.numel, 0
        while done < numel:
            offset = -(-used // ALIGN) * ALIGN
            take = min(numel - done, (sizes.chunk - offset) // size) if offset < sizes.chunk else 0
            if take <= 0:
                out.append(_packed(peer, pieces, used))
                pieces, used = [], 0
                continue
            pieces.append(Piece(item, done, done + take, offset, take * size))
            used = offset + take * size
            done += take
    if pieces:
        out.append(_packed(peer, pieces, used))
    return out


def _packed(peer: int, pieces: list[Piece], nbytes: int) -> Message:
    return Message(
        peer, 0, tuple(pieces), False, nbytes, src_contiguous=False, dst_contiguous=False
    )


def _with_tag(message: Message, tag: int) -> Message:
    m = message
    return Message(m.peer, tag, m.pieces, m.direct, m.nbytes, m.src_contiguous, m.dst_contiguous)


def _rounds(messages: list[Message], chunk: int) -> tuple[tuple[Message, ...], ...]:
    rounds: list[list[Message]] = []
    used = chunk
    for message in messages:
        if used + message.nbytes > chunk:
            rounds.append([])
            used = 0
        rounds[-1].append(message)
        used += message.nbytes
    return tuple(tuple(r) for r in rounds)
