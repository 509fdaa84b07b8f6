"""Messages, views, clocks and reports of plan execution (the executor's building blocks).

:class:`Piece` and :class:`Message` describe what travels between two ranks; the view
helpers find the slice of a rank's shard that a plan item reads or writes; :func:`checksum`
is the per-piece checksum both ends compute; :func:`post` and :func:`wait` wrap
``batch_isend_irecv`` with explicit timeouts and turn transport failures into
``MigrationError``. Used by :mod:`.executor`; runs on the rank executing a plan.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dynarl.errors import MigrationError
from dynarl.migrate.plan import ReshardPlan, Transfer
from dynarl.migrate.region import Region, Shard, flat_range_boxes

__all__ = [
    "ALIGN",
    "Message",
    "Piece",
    "Stopwatch",
    "Timer",
    "TransferReport",
    "ViewIndex",
    "as_bytes",
    "checksum",
    "device_of",
    "index_device",
    "int64_tensor",
    "locate",
    "pair_items",
    "piece_boxes",
    "post",
    "region_view",
    "schedule",
    "view_index",
    "wait",
]

ALIGN = 8
"""Byte alignment of every piece inside a packed message (any dtype views it in place)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferReport:
    """What one rank did and how long each part took."""

    bytes_sent: int
    """Bytes this rank sent to other ranks."""
    bytes_received: int
    """Bytes it received."""
    bytes_local: int
    """Bytes it copied locally."""
    num_rounds: int
    """Network rounds (same on every rank)."""
    num_messages: int
    """Messages this rank posted (sends and receives, checksums excluded)."""
    copy_s: float
    """Seconds packing, unpacking and copying locally."""
    wire_s: float
    """Seconds from posting a round's sends and receives until all completed, summed (the
    local copies overlapping the first round included)."""
    checksum_s: float
    """Seconds checksumming and comparing not hidden behind the network."""
    first_post_s: float = 0.0
    """Seconds from the start of the transfer until this rank posted its first message."""
    posted_at: tuple[float, ...] = ()
    """Per round, ``time.monotonic()`` when this rank had posted everything (system-wide
    clock: comparable across the ranks of one machine)."""
    done_at: tuple[float, ...] = ()
    """Per round, ``time.monotonic()`` when this rank's transfers had all completed."""
    mismatched: tuple[Shard, ...] = field(default=())
    """Destination shards on this rank whose data did not match the source's."""

    @property
    def verified(self) -> bool:
        """Whether every destination shard on this rank matched its sources."""
        return not self.mismatched


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, stop)`` (row-major) of ``item``, at ``offset`` of its message."""

    item: Transfer
    start: int
    stop: int
    offset: int
    nbytes: int


@dataclass(slots=True)
class Message:
    """One isend or irecv: packed small pieces, or one piece of a large item."""

    peer: int
    pieces: list[Piece]
    direct: bool
    nbytes: int = 0
    buffer: torch.Tensor | None = None


def checksum(data: torch.Tensor) -> int:
    """A position-sensitive checksum of a contiguous 1-D uint8 tensor.

    CPU: CRC-32 (zlib, releases the GIL). CUDA: a weighted sum of 32-bit words computed on
    the device, so verification does not copy the data to the host.
    """
    assert data.dtype == torch.uint8 and data.dim() == 1
    if data.device.type == "cpu":
        return zlib.crc32(data.numpy().data)
    padded = torch.nn.functional.pad(data, (0, -data.numel() % 4))
    words = padded.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, device=data.device, dtype=torch.int64)
    return int((words * (weights * 2654435761 + 1)).sum().item()) & 0xFFFFFFFFFFFFFFFF


class Stopwatch:
    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.total += time.perf_counter() - self._start


class Timer:
    def __init__(self) -> None:
        self.copy, self.wire, self.checksum = Stopwatch(), Stopwatch(), Stopwatch()
        self.start = time.perf_counter()
        self.first_post: float | None = None
        self.posted: list[float] = []
        self.done: list[float] = []


ViewIndex = dict[str, list[tuple[Region, torch.Tensor, Shard]]]


def view_index(
    shards: tuple[Shard, ...], views: Mapping[Shard, torch.Tensor], rank: int, side: str
) -> ViewIndex:
    index: ViewIndex = defaultdict(list)
    for shard in shards:
        if shard.rank != rank:
            continue
        view = views.get(shard)
        if view is None:
            raise ValueError(f"no {side} view for {shard.tensor!r} {shard.region} on rank {rank}")
        if tuple(view.shape) != shard.region.sizes:
            raise ValueError(
                f"{side} view of {shard.tensor!r} {shard.region} on rank {rank} has shape "
                f"{tuple(view.shape)}"
            )
        index[shard.tensor].append((shard.region, view, shard))
    return index


def locate(index: ViewIndex, tensor: str, region: Region) -> tuple[Region, torch.Tensor, Shard]:
    for entry in index[tensor]:
        if entry[0].contains(region):
            return entry
    raise AssertionError(f"plan item {tensor} {region} outside this rank's shards")


def region_view(index: ViewIndex, item: Transfer, region: Region) -> torch.Tensor:
    outer, view, _ = locate(index, item.tensor, region)
    return view[region.relative_to(outer).slices() or ...]


def pair_items(plan: ReshardPlan, rank: int, *, outgoing: bool) -> dict[int, list[Transfer]]:
    out: dict[int, list[Transfer]] = defaultdict(list)
    for item in plan.items:
        if item.is_local:
            continue
        if outgoing and item.src_rank == rank:
            out[item.dst_rank].append(item)
        elif not outgoing and item.dst_rank == rank:
            out[item.src_rank].append(item)
    return dict(out)


def piece_boxes(piece: Piece) -> list[Region]:
    region = piece.item.region
    return [
        Region(
            offsets=tuple(a + b for a, b in zip(region.offsets, box.offsets, strict=True)),
            sizes=box.sizes,
        )
        for box in flat_range_boxes(region.sizes, piece.start, piece.stop)
    ]


def as_bytes(view: torch.Tensor) -> torch.Tensor:
    return view.reshape(-1).view(torch.uint8)


def int64_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    signed = [v - (1 << 64) if v >= 1 << 63 else v for v in values]
    return torch.tensor(signed, dtype=torch.int64, device=device)


def post(ops: list[dist.P2POp], what: str) -> list[dist.Work]:
    """Post all of a round's sends and receives as one batch (one NCCL group)."""
    if not ops:
        return []
    try:
        return list(dist.batch_isend_irecv(ops))
    except RuntimeError as exc:
        raise MigrationError(f"reshard {what} failed: {exc}") from exc


def wait(works: list[dist.Work], timeout_s: float, what: str) -> None:
    try:
        for work in works:
            if not work.wait(timedelta(seconds=timeout_s)):
                raise MigrationError(f"reshard {what}: a transfer did not complete")
    except RuntimeError as exc:
        raise MigrationError(f"reshard {what} failed: {exc}") from exc


def device_of(views: Mapping[Shard, torch.Tensor]) -> torch.device:
    return next((v.device for v in views.values()), torch.device("cpu"))


def index_device(index: ViewIndex) -> torch.device:
    return next(
        (view.device for entries in index.values() for _, view, _ in entries), torch.device("cpu")
    )


def schedule(
    peer: int,
    items: list[Transfer],
    itemsize: Mapping[str, int],
    chunk_bytes: int,
    direct_bytes: int,
) -> list[list[Message]]:
    """Rounds of messages to or from ``peer``: each round at most ``chunk_bytes``.

    Items of at least ``direct_bytes`` are messages of their own (cut at ``chunk_bytes``);
    smaller ones are packed, each piece aligned to 8 bytes. Pure: both ends of a pair
    compute the same rounds from the plan.
    """
    chunk, messages = chunk_bytes, []
    packed = Message(peer, [], direct=False)
    for item in items:
        size = itemsize[item.tensor]
        numel = item.region.numel
        if numel * size >= direct_bytes:
            step = max(1, chunk // size)
            for start in range(0, numel, step):
                stop = min(numel, start + step)
                piece = Piece(item, start, stop, 0, (stop - start) * size)
                messages.append(Message(peer, [piece], direct=True, nbytes=piece.nbytes))
            continue
        done = 0
        while done < numel:
            offset = -(-packed.nbytes // ALIGN) * ALIGN
            take = min(numel - done, (chunk - offset) // size) if offset < chunk else 0
            if take <= 0:
                messages.append(packed)
                packed = Message(peer, [], direct=False)
                continue
            packed.pieces.append(Piece(item, done, done + take, offset, take * size))
            packed.nbytes = offset + take * size
            done += take
    if packed.pieces:
        messages.append(packed)
    rounds: list[list[Message]] = []
    used = chunk
    for message in messages:
        if used + message.nbytes > chunk:
            rounds.append([])
            used = 0
        rounds[-1].append(message)
        used += message.nbytes
    return rounds
