"""Views, checksums, clocks and reports of plan execution (the executor's building blocks).

The view helpers find the slice of a rank's shard that a plan item reads or writes; :func:`checksum`
is the per-piece checksum both ends compute; :func:`post` and :func:`wait` wrap
``batch_isend_irecv`` with explicit timeouts and turn transport failures into
``MigrationError``. Used by :mod:`._executor`; runs on the rank executing a plan.
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
from dynarl.migrate._region import Region, Shard
from dynarl.migrate._reshard_plan import Transfer

__all__ = [
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
    "post",
    "region_view",
    "view_index",
    "wait",
]


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
    """Network rounds this rank took part in (its busiest pair's)."""
    num_messages: int
    """Messages this rank posted (sends and receives, checksums excluded)."""
    copy_s: float
    """Seconds packing, unpacking and copying locally."""
    wire_s: float
    """Seconds from posting each round's sends and receives (packed) until all completed,
    summed (the local copies that overlap the first round on CUDA included)."""
    checksum_s: float
    """Seconds checksumming and comparing not hidden behind the network."""
    first_post_s: float = 0.0
    """Seconds from the start of the transfer until this rank posted its first round."""
    ready_at: tuple[float, ...] = ()
    """Per round, ``time.monotonic()`` when this rank had packed everything and began to
    post (system-wide clock: comparable across the ranks of one machine). Taken before
    posting because gloo writes a send in the posting call when its receive is posted."""
    done_at: tuple[float, ...] = ()
    """Per round, ``time.monotonic()`` when this rank's transfers had all completed."""
    mismatched: tuple[Shard, ...] = field(default=())
    """Destination shards on this rank whose data did not match the source's."""

    @property
    def verified(self) -> bool:
        """Whether every destination shard on this rank matched its sources."""
        return not self.mismatched


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
        self.ready: list[float] = []
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
