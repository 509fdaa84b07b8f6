"""Carry a ReshardPlan out over torch.distributed: batched isend/irecv, bounded memory.

Every rank of the plan calls :func:`execute_plan` with the same plan, a group spanning the
plan's ranks, views of the shards it holds now (``sources``) and views of the freshly
allocated shards it will hold (``destinations``). Local items are copied directly. Remote
items travel in rounds: per peer, items are cut into element-aligned pieces and packed
into one byte buffer of at most ``chunk_bytes`` per round, all pairs are posted with one
``batch_isend_irecv`` and waited with an explicit timeout, then unpacked. Both ends derive
the same schedule from the plan, so no sizes are exchanged. Staging memory per rank is at
most ``chunk_bytes`` per peer it sends to or receives from. With ``verify``, every piece is
checksummed at the source (the bytes read from the source shard) and at the destination
(the bytes read back from the destination shard); the source checksums follow in a last
round, and mismatching destination shards are reported. Gloo (CPU tensors) and NCCL (CUDA
tensors) take the same code path.

Runs on every rank of the plan, in the trainer's thread; blocks until done or timed out.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dynarl.errors import MigrationError
from dynarl.migrate.groups import CommGroup
from dynarl.migrate.plan import ReshardPlan, Transfer
from dynarl.migrate.region import Region, Shard, flat_range_boxes

__all__ = ["ExecutorConfig", "TransferReport", "checksum", "execute_plan"]

logger = logging.getLogger(__name__)

_ALIGN = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutorConfig:
    """How :func:`execute_plan` moves bytes."""

    chunk_bytes: int = 64 << 20
    """Most bytes staged per peer per round (bounds the extra memory)."""
    timeout_s: float = 60.0
    """Deadline of every wait on the network, seconds."""
    verify: bool = True
    """Checksum every piece at both ends and report mismatching destination shards."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < _ALIGN:
            raise ValueError(f"chunk_bytes must be >= {_ALIGN}, got {self.chunk_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


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
    copy_s: float
    """Seconds packing, unpacking and copying locally."""
    wire_s: float
    """Seconds from posting the sends and receives of a round until all completed."""
    checksum_s: float
    """Seconds computing and exchanging checksums."""
    mismatched: tuple[Shard, ...] = field(default=())
    """Destination shards on this rank whose checksum did not match the source's."""

    @property
    def verified(self) -> bool:
        """Whether every destination shard on this rank matched its sources."""
        return not self.mismatched


@dataclass(frozen=True, slots=True)
class _Piece:
    """Elements ``[start, stop)`` (row-major) of ``item``, at ``offset`` of its round buffer."""

    item: Transfer
    start: int
    stop: int
    offset: int
    nbytes: int


def checksum(data: torch.Tensor) -> int:
    """A position-sensitive checksum of a contiguous uint8 tensor.

    CPU: CRC-32 (zlib). CUDA: a weighted sum of 32-bit words computed on the device, so
    verification does not copy the data to the host.
    """
    assert data.dtype == torch.uint8 and data.dim() == 1
    if data.device.type == "cpu":
        return zlib.crc32(data.numpy().data)
    padded = torch.nn.functional.pad(data, (0, -data.numel() % 4))
    words = padded.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, device=data.device, dtype=torch.int64)
    return int((words * (weights * 2654435761 + 1)).sum().item()) & 0xFFFFFFFFFFFFFFFF


def execute_plan(
    plan: ReshardPlan,
    *,
    rank: int,
    group: CommGroup | None,
    sources: Mapping[Shard, torch.Tensor],
    destinations: Mapping[Shard, torch.Tensor],
    config: ExecutorConfig | None = None,
) -> TransferReport:
    """Run this rank's part of ``plan``.

    ``sources``/``destinations`` map every shard of ``plan.src``/``plan.dst`` held by
    ``rank`` to a tensor view shaped like its region. ``group`` must span every rank that
    sends or receives (None only when nothing crosses ranks). Raises ValueError when a view
    is missing or misshaped, MigrationError when a wait exceeds the timeout or the
    transport fails; destination views may then hold partial data, sources are untouched.
    """
    config = config or ExecutorConfig()
    src_index = _view_index(plan.src, sources, rank, "source")
    dst_index = _view_index(plan.dst, destinations, rank, "destination")
    timer = _Timer()
    with timer.copy:
        for item in plan.items:
            if item.is_local and item.dst_rank == rank:
                _slice(dst_index, item).copy_(_slice(src_index, item))
    sends = _streams(plan, rank, outgoing=True)
    recvs = _streams(plan, rank, outgoing=False)
    if (sends or recvs) and group is None:
        raise ValueError(f"rank {rank} has remote transfers but no group was given")
    schedule = {peer: _rounds(plan, items, config.chunk_bytes) for peer, items in sends.items()}
    inbound = {peer: _rounds(plan, items, config.chunk_bytes) for peer, items in recvs.items()}
    num_rounds = max((len(r) for r in [*schedule.values(), *inbound.values()]), default=0)
    sent_sums: dict[int, list[int]] = defaultdict(list)
    got_sums: dict[int, list[tuple[_Piece, int]]] = defaultdict(list)
    buffers: dict[tuple[str, int], torch.Tensor] = {}
    device = _device(sources, destinations)
    for round_index in range(num_rounds):
        ops: list[dist.P2POp] = []
        incoming: list[tuple[int, list[_Piece], torch.Tensor]] = []
        for peer, rounds in schedule.items():
            if round_index < len(rounds):
                buf = _buffer(buffers, ("send", peer), rounds, device)
                with timer.copy:
                    _pack(plan, src_index, rounds[round_index], buf)
                if config.verify:
                    with timer.checksum:
                        sent_sums[peer] += [_sum_buffer(buf, p) for p in rounds[round_index]]
                ops.append(_op(dist.isend, buf, peer, group))
        for peer, rounds in inbound.items():
            if round_index < len(rounds):
                buf = _buffer(buffers, ("recv", peer), rounds, device)
                incoming.append((peer, rounds[round_index], buf))
                ops.append(_op(dist.irecv, buf, peer, group))
        with timer.wire:
            _wait(ops, config.timeout_s, f"round {round_index}")
        for peer, pieces, buf in incoming:
            with timer.copy:
                _unpack(plan, dst_index, pieces, buf)
            if config.verify:
                with timer.checksum:
                    got_sums[peer] += [(p, _sum_destination(plan, dst_index, p)) for p in pieces]
    buffers.clear()
    mismatched: set[Shard] = set()
    if config.verify:
        with timer.checksum:
            mismatched = _verify(plan, rank, group, sent_sums, got_sums, dst_index, src_index)
            mismatched |= _verify_local(plan, rank, src_index, dst_index)
    report = TransferReport(
        bytes_sent=sum(plan.item_bytes(i) for items in sends.values() for i in items),
        bytes_received=sum(plan.item_bytes(i) for items in recvs.values() for i in items),
        bytes_local=sum(
            plan.item_bytes(i) for i in plan.items if i.is_local and i.dst_rank == rank
        ),
        num_rounds=num_rounds,
        copy_s=timer.copy.total,
        wire_s=timer.wire.total,
        checksum_s=timer.checksum.total,
        mismatched=tuple(sorted(mismatched, key=lambda s: (s.tensor, s.region.offsets))),
    )
    logger.debug("rank %d executed plan: %s", rank, report)
    return report


class _Stopwatch:
    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.total += time.perf_counter() - self._start


class _Timer:
    def __init__(self) -> None:
        self.copy, self.wire, self.checksum = _Stopwatch(), _Stopwatch(), _Stopwatch()


_Index = dict[str, list[tuple[Region, torch.Tensor, Shard]]]


def _view_index(
    shards: tuple[Shard, ...], views: Mapping[Shard, torch.Tensor], rank: int, side: str
) -> _Index:
    index: _Index = defaultdict(list)
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


def _locate(index: _Index, tensor: str, region: Region) -> tuple[Region, torch.Tensor, Shard]:
    for entry in index[tensor]:
        if entry[0].contains(region):
            return entry
    raise AssertionError(f"plan item {tensor} {region} outside this rank's shards")


def _slice(index: _Index, item: Transfer, region: Region | None = None) -> torch.Tensor:
    region = region or item.region
    outer, view, _ = _locate(index, item.tensor, region)
    return view[region.relative_to(outer).slices() or ...]


def _streams(plan: ReshardPlan, rank: int, *, outgoing: bool) -> dict[int, list[Transfer]]:
    out: dict[int, list[Transfer]] = defaultdict(list)
    for item in plan.items:
        if item.is_local:
            continue
        if outgoing and item.src_rank == rank:
            out[item.dst_rank].append(item)
        elif not outgoing and item.dst_rank == rank:
            out[item.src_rank].append(item)
    return dict(out)


def _rounds(plan: ReshardPlan, items: list[Transfer], chunk: int) -> list[list[_Piece]]:
    """Cut a pair's items into element-aligned pieces, at most ``chunk`` bytes per round."""
    rounds: list[list[_Piece]] = [[]]
    used = 0
    for item in items:
        size = plan.spec(item.tensor).itemsize
        done, numel = 0, item.region.numel
        while done < numel:
            offset = -(-used // _ALIGN) * _ALIGN
            take = min(numel - done, (chunk - offset) // size) if offset < chunk else 0
            if take <= 0:
                rounds.append([])
                used = 0
                continue
            rounds[-1].append(_Piece(item, done, done + take, offset, take * size))
            used = offset + take * size
            done += take
    return rounds if rounds[0] else []


def _piece_boxes(piece: _Piece) -> list[Region]:
    region = piece.item.region
    return [
        Region(
            offsets=tuple(a + b for a, b in zip(region.offsets, box.offsets, strict=True)),
            sizes=box.sizes,
        )
        for box in flat_range_boxes(region.sizes, piece.start, piece.stop)
    ]


def _buffer(
    buffers: dict[tuple[str, int], torch.Tensor],
    key: tuple[str, int],
    rounds: list[list[_Piece]],
    device: torch.device,
) -> torch.Tensor:
    if key not in buffers:
        size = max(p.offset + p.nbytes for r in rounds for p in r)
        buffers[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return buffers[key]


def _typed(
    buf: torch.Tensor, offset: int, dtype: torch.dtype, sizes: tuple[int, ...]
) -> torch.Tensor:
    nbytes = torch.empty((), dtype=dtype).element_size() * (torch.Size(sizes).numel())
    return buf[offset : offset + nbytes].view(dtype).view(sizes)


def _pack(plan: ReshardPlan, index: _Index, pieces: list[_Piece], buf: torch.Tensor) -> None:
    for piece in pieces:
        dtype = getattr(torch, plan.spec(piece.item.tensor).dtype)
        offset = piece.offset
        for box in _piece_boxes(piece):
            target = _typed(buf, offset, dtype, box.sizes)
            target.copy_(_slice(index, piece.item, box))
            offset += target.numel() * target.element_size()


def _unpack(plan: ReshardPlan, index: _Index, pieces: list[_Piece], buf: torch.Tensor) -> None:
    for piece in pieces:
        dtype = getattr(torch, plan.spec(piece.item.tensor).dtype)
        offset = piece.offset
        for box in _piece_boxes(piece):
            source = _typed(buf, offset, dtype, box.sizes)
            _slice(index, piece.item, box).copy_(source)
            offset += source.numel() * source.element_size()


def _sum_buffer(buf: torch.Tensor, piece: _Piece) -> int:
    return checksum(buf[piece.offset : piece.offset + piece.nbytes])


def _sum_destination(plan: ReshardPlan, index: _Index, piece: _Piece) -> int:
    parts = [_bytes(_slice(index, piece.item, box)) for box in _piece_boxes(piece)]
    return checksum(torch.cat(parts) if len(parts) > 1 else parts[0])


def _bytes(view: torch.Tensor) -> torch.Tensor:
    return view.contiguous().reshape(-1).view(torch.uint8)


def _op(fn: object, buf: torch.Tensor, peer: int, group: CommGroup | None) -> dist.P2POp:
    assert group is not None
    return dist.P2POp(fn, buf, group=group.pg, group_peer=group.group_rank(peer))  # type: ignore[arg-type]


def _wait(ops: list[dist.P2POp], timeout_s: float, what: str) -> None:
    if not ops:
        return
    try:
        works = dist.batch_isend_irecv(ops)
        for work in works:
            if not work.wait(timedelta(seconds=timeout_s)):
                raise MigrationError(f"reshard {what}: a transfer did not complete")
    except MigrationError:
        raise
    except RuntimeError as exc:
        raise MigrationError(f"reshard {what} failed: {exc}") from exc


def _verify(
    plan: ReshardPlan,
    rank: int,
    group: CommGroup | None,
    sent_sums: dict[int, list[int]],
    got_sums: dict[int, list[tuple[_Piece, int]]],
    dst_index: _Index,
    src_index: _Index,
) -> set[Shard]:
    """Send source checksums to each receiver; compare with what arrived."""
    device = _device_of(dst_index, src_index)
    ops = []
    received: dict[int, torch.Tensor] = {}
    for peer, sums in sent_sums.items():
        ops.append(_op(dist.isend, _as_tensor(sums, device), peer, group))
    for peer, pairs in got_sums.items():
        received[peer] = torch.empty(len(pairs), dtype=torch.int64, device=device)
        ops.append(_op(dist.irecv, received[peer], peer, group))
    _wait(ops, 60.0, "checksum exchange")
    bad: set[Shard] = set()
    for peer, pairs in got_sums.items():
        theirs = [v & 0xFFFFFFFFFFFFFFFF for v in received[peer].tolist()]
        for (piece, mine), expected in zip(pairs, theirs, strict=True):
            if mine != expected:
                bad.add(_locate(dst_index, piece.item.tensor, piece.item.region)[2])
    return bad


def _verify_local(plan: ReshardPlan, rank: int, src_index: _Index, dst_index: _Index) -> set[Shard]:
    bad = set()
    for item in plan.items:
        if item.is_local and item.dst_rank == rank:
            if checksum(_bytes(_slice(src_index, item))) != checksum(
                _bytes(_slice(dst_index, item))
            ):
                bad.add(_locate(dst_index, item.tensor, item.region)[2])
    return bad


def _as_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    signed = [v - (1 << 64) if v >= 1 << 63 else v for v in values]
    return torch.tensor(signed, dtype=torch.int64, device=device)


def _device(*maps: Mapping[Shard, torch.Tensor]) -> torch.device:
    for views in maps:
        for view in views.values():
            return view.device
    return torch.device("cpu")


def _device_of(*indexes: _Index) -> torch.device:
    for index in indexes:
        for entries in index.values():
            for _, view, _ in entries:
                return view.device
    return torch.device("cpu")
