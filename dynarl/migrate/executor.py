"""Carry a ReshardPlan out over torch.distributed: batched isend/irecv, bounded memory.

Every rank of the plan builds a :class:`PlanExecutor` with the same plan and a group over
the plan's ranks. :meth:`PlanExecutor.prepare` (before the trainer pauses) derives the
message schedule from the plan alone, so both ends agree without exchanging sizes, and
allocates and touches the staging buffers. :meth:`PlanExecutor.run` (during the pause)
copies local items, then sends in rounds: items of at least ``direct_bytes`` travel as their
own messages straight from the source shard and into the destination shard when those
views are contiguous (a staging buffer otherwise); smaller items are packed per peer into
one buffer. A round carries at most ``chunk_bytes`` per peer and direction (large items are
cut into element-aligned pieces), is posted with one ``batch_isend_irecv`` and waited with an
explicit timeout. With ``verify``, every remote piece is checksummed (CRC-32 on CPU, a
device-side weighted sum on CUDA) at the source, from the bytes read there, and at the
destination, from the bytes read back there; source checksums follow in a last message per
peer. Local copies are compared bitwise. Mismatching destination shards are reported. Gloo
(CPU) and NCCL (CUDA) take the same path.

Runs on every rank of the plan, in the trainer's thread; blocks until done or timed out.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynarl.migrate.groups import CommGroup
from dynarl.migrate.plan import ReshardPlan, Transfer
from dynarl.migrate.region import Shard
from dynarl.migrate.staging import (
    ALIGN,
    Message,
    Piece,
    Timer,
    TransferReport,
    ViewIndex,
    as_bytes,
    checksum,
    device_of,
    index_device,
    int64_tensor,
    locate,
    pair_items,
    piece_boxes,
    post,
    region_view,
    schedule,
    view_index,
    wait,
)

__all__ = ["ExecutorConfig", "PlanExecutor", "TransferReport", "checksum", "execute_plan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutorConfig:
    """How a plan's bytes move."""

    chunk_bytes: int = 64 << 20
    """Most bytes in flight per peer and direction per round (bounds staging memory)."""
    direct_bytes: int = 1 << 20
    """Items at least this large travel as their own messages (no packing when contiguous)."""
    timeout_s: float = 60.0
    """Deadline of every wait on the network, seconds."""
    verify: bool = True
    """Checksum remote pieces at both ends and compare local copies bitwise."""
    checksum_threads: int = 2
    """Threads computing checksums (CRC-32 releases the GIL), overlapping the network."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < ALIGN or self.direct_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= {ALIGN} and direct_bytes >= 1")
        if self.timeout_s <= 0 or self.checksum_threads < 1:
            raise ValueError("timeout_s must be > 0 and checksum_threads >= 1")


def execute_plan(
    plan: ReshardPlan,
    *,
    rank: int,
    group: CommGroup | None,
    sources: Mapping[Shard, torch.Tensor],
    destinations: Mapping[Shard, torch.Tensor],
    config: ExecutorConfig | None = None,
) -> TransferReport:
    """Prepare and run this rank's part of ``plan`` in one call (see :class:`PlanExecutor`)."""
    executor = PlanExecutor(plan, rank=rank, group=group, config=config)
    executor.prepare(destinations)
    return executor.run(sources)


class PlanExecutor:
    """This rank's part of a plan: schedule and buffers first, then the transfer.

    ``group`` must span every rank that sends or receives (None only when nothing crosses
    ranks); raises ValueError otherwise.
    """

    def __init__(
        self,
        plan: ReshardPlan,
        *,
        rank: int,
        group: CommGroup | None,
        config: ExecutorConfig | None = None,
    ) -> None:
        self.plan, self.rank, self.group = plan, rank, group
        self.config = config or ExecutorConfig()
        self._itemsize = {t.name: t.itemsize for t in plan.tensors}
        self._dtype = {t.name: getattr(torch, t.dtype) for t in plan.tensors}
        sends = pair_items(plan, rank, outgoing=True)
        recvs = pair_items(plan, rank, outgoing=False)
        if (sends or recvs) and group is None:
            raise ValueError(f"rank {rank} has remote transfers but no group was given")
        sizes = (self._itemsize, self.config.chunk_bytes, self.config.direct_bytes)
        self._sends = {p: schedule(p, items, *sizes) for p, items in sends.items()}
        self._recvs = {p: schedule(p, items, *sizes) for p, items in recvs.items()}
        counts = [len(r) for r in (*self._sends.values(), *self._recvs.values())]
        self.num_rounds = max(counts, default=0)
        self._dst: ViewIndex = {}

    def prepare(
        self,
        destinations: Mapping[Shard, torch.Tensor],
        sources: Mapping[Shard, torch.Tensor] | None = None,
    ) -> None:
        """Index the destination views and allocate (and touch) the staging buffers.

        ``sources``, when given, lets large non-contiguous sends be staged now too (their
        views are looked up again at :meth:`run`). Runs before the pause; raises ValueError
        for a missing or misshaped view.
        """
        self._dst = view_index(self.plan.dst, destinations, self.rank, "destination")
        src = view_index(self.plan.src, sources, self.rank, "source") if sources else None
        device = device_of(destinations) if destinations else device_of(sources or {})
        for rounds in self._recvs.values():
            for message in (m for r in rounds for m in r):
                if not message.direct or self._contiguous(self._dst, message.pieces[0]) is None:
                    message.buffer = torch.zeros(message.nbytes, dtype=torch.uint8, device=device)
        for rounds in self._sends.values():
            for message in (m for r in rounds for m in r):
                staged = src is None or self._contiguous(src, message.pieces[0]) is None
                if not message.direct or (src is not None and staged):
                    message.buffer = torch.zeros(message.nbytes, dtype=torch.uint8, device=device)

    def run(self, sources: Mapping[Shard, torch.Tensor]) -> TransferReport:
        """Move the data (the old state is only read). Raises MigrationError when a wait
        exceeds the timeout or the transport fails; destinations may then hold partial data."""
        src = view_index(self.plan.src, sources, self.rank, "source")
        timer = Timer()
        mismatched: set[Shard] = set()
        local = [i for i in self.plan.items if i.is_local and i.dst_rank == self.rank]

        def copy_local() -> None:
            with timer.copy:
                for item in local:
                    region_view(self._dst, item, item.region).copy_(
                        region_view(src, item, item.region)
                    )

        with ThreadPoolExecutor(self.config.checksum_threads) as pool:
            sent: dict[int, list[int]] = defaultdict(list)
            got: list[tuple[Piece, int]] = []
            # On CUDA local copies overlap the first round; on CPU they follow the rounds
            # (a memcpy and the loopback transport would compete for the same cores).
            overlap = index_device(src).type == "cuda" and self.num_rounds > 0
            for index in range(self.num_rounds):
                self._round(
                    index,
                    src,
                    pool,
                    timer,
                    sent,
                    got,
                    copy_local if overlap and index == 0 else None,
                )
            if not overlap:
                copy_local()
            if self.config.verify:
                with timer.checksum:
                    mismatched |= self._exchange_checksums(sent, got)
                    mismatched |= {
                        s for s in pool.map(lambda i: self._local_differs(src, i), local) if s
                    }
        return self._report(timer, mismatched)

    def _round(
        self,
        index: int,
        src: ViewIndex,
        pool: ThreadPoolExecutor,
        timer: Timer,
        sent: dict[int, list[int]],
        got: list[tuple[Piece, int]],
        meanwhile: Callable[[], None] | None,
    ) -> None:
        """Post one round's sends and receives, run ``meanwhile``, wait, unpack, checksum.

        Source checksums overlap the transfer on CUDA (device work beside the NCCL DMA);
        on CPU they follow it, since loopback transport and CRC compete for the same cores.
        """
        outgoing = [
            (peer, tag, m)
            for peer, rounds in self._sends.items()
            for tag, m in enumerate(rounds[index] if index < len(rounds) else [])
        ]
        incoming = [
            (peer, tag, m)
            for peer, rounds in self._recvs.items()
            for tag, m in enumerate(rounds[index] if index < len(rounds) else [])
        ]
        overlap = self.config.verify and index_device(src).type == "cuda"
        # One batch per round (one NCCL group): every send packed first, then all posted.
        ops = [self._recv_op(p, t, m) for p, t, m in incoming]
        with timer.copy:
            ops += [self._send_op(src, p, t, m) for p, t, m in outgoing]
        posted = time.perf_counter()
        timer.first_post = timer.first_post or posted - timer.start
        works = post(ops, f"round {index}")
        timer.posted.append(time.monotonic())
        pending = self._sum_sources(pool, src, outgoing) if overlap else []
        if meanwhile is not None:
            meanwhile()
        wait(works, self.config.timeout_s, f"round {index}")
        timer.done.append(time.monotonic())
        timer.wire.total += time.perf_counter() - posted  # this rank's post to completion
        with timer.copy:
            for _, _, message in incoming:
                if message.buffer is not None:
                    self._unpack(message)
        if not self.config.verify:
            return
        with timer.checksum:
            if not overlap:
                pending = self._sum_sources(pool, src, outgoing)
            pieces = [p for _, _, m in incoming for p in m.pieces]
            got += list(zip(pieces, pool.map(self._sum_destination, pieces), strict=True))
            for peer, future in pending:
                sent[peer].append(future.result())

    def _sum_sources(
        self, pool: ThreadPoolExecutor, src: ViewIndex, outgoing: list[tuple[int, int, Message]]
    ) -> list[tuple[int, Future[int]]]:
        return [
            (peer, pool.submit(self._sum_source, src, message, piece))
            for peer, _, message in outgoing
            for piece in message.pieces
        ]

    def _send_op(self, src: ViewIndex, peer: int, tag: int, message: Message) -> dist.P2POp:
        return self._op(dist.isend, self._outgoing(src, message), peer, tag)

    def _recv_op(self, peer: int, tag: int, message: Message) -> dist.P2POp:
        target = message.buffer
        if target is None:
            target = self._contiguous(self._dst, message.pieces[0])
        assert target is not None
        return self._op(dist.irecv, target, peer, tag)

    def _outgoing(self, src: ViewIndex, message: Message) -> torch.Tensor:
        if message.direct and message.buffer is None:
            view = self._contiguous(src, message.pieces[0])
            if view is not None:
                return view
            message.buffer = torch.empty(
                message.nbytes, dtype=torch.uint8, device=index_device(src)
            )
        assert message.buffer is not None
        for piece in message.pieces:
            offset = piece.offset
            for box in piece_boxes(piece):
                target = self._typed(message.buffer, offset, piece.item.tensor, box.sizes)
                target.copy_(region_view(src, piece.item, box))
                offset += target.numel() * target.element_size()
        return message.buffer

    def _unpack(self, message: Message) -> None:
        assert message.buffer is not None
        for piece in message.pieces:
            offset = piece.offset
            for box in piece_boxes(piece):
                source = self._typed(message.buffer, offset, piece.item.tensor, box.sizes)
                region_view(self._dst, piece.item, box).copy_(source)
                offset += source.numel() * source.element_size()

    def _typed(
        self, buf: torch.Tensor, offset: int, tensor: str, sizes: tuple[int, ...]
    ) -> torch.Tensor:
        nbytes = self._itemsize[tensor] * torch.Size(sizes).numel()
        return buf[offset : offset + nbytes].view(self._dtype[tensor]).view(sizes)

    def _contiguous(self, index: ViewIndex, piece: Piece) -> torch.Tensor | None:
        """The piece as a 1-D byte view of its shard, when it is one contiguous box."""
        boxes = piece_boxes(piece)
        if len(boxes) != 1:
            return None
        view = region_view(index, piece.item, boxes[0])
        return as_bytes(view) if view.is_contiguous() else None

    def _sum_source(self, src: ViewIndex, message: Message, piece: Piece) -> int:
        if message.buffer is None:
            view = self._contiguous(src, piece)
            assert view is not None
            return checksum(view)
        return checksum(message.buffer[piece.offset : piece.offset + piece.nbytes])

    def _sum_destination(self, piece: Piece) -> int:
        parts = [
            as_bytes(region_view(self._dst, piece.item, box).contiguous())
            for box in piece_boxes(piece)
        ]
        return checksum(torch.cat(parts) if len(parts) > 1 else parts[0])

    def _local_differs(self, src: ViewIndex, item: Transfer) -> Shard | None:
        a = as_bytes(region_view(src, item, item.region).contiguous())
        b = as_bytes(region_view(self._dst, item, item.region).contiguous())
        return None if torch.equal(a, b) else locate(self._dst, item.tensor, item.region)[2]

    def _exchange_checksums(
        self, sent: dict[int, list[int]], got: list[tuple[Piece, int]]
    ) -> set[Shard]:
        device = index_device(self._dst)
        by_peer: dict[int, list[tuple[Piece, int]]] = defaultdict(list)
        for piece, value in got:
            by_peer[piece.item.src_rank].append((piece, value))
        received = {
            p: torch.empty(len(v), dtype=torch.int64, device=device) for p, v in by_peer.items()
        }
        ops = [self._op(dist.isend, int64_tensor(v, device), p, 0) for p, v in sent.items()]
        ops += [self._op(dist.irecv, t, p, 0) for p, t in received.items()]
        wait(post(ops, "checksum exchange"), self.config.timeout_s, "checksum exchange")
        bad = set()
        for peer, pairs in by_peer.items():
            theirs = [v & 0xFFFFFFFFFFFFFFFF for v in received[peer].tolist()]
            for (piece, mine), expected in zip(pairs, theirs, strict=True):
                if mine != expected:
                    bad.add(locate(self._dst, piece.item.tensor, piece.item.region)[2])
        return bad

    def _op(self, fn: Callable[..., object], buf: torch.Tensor, peer: int, tag: int) -> dist.P2POp:
        assert self.group is not None
        return dist.P2POp(
            fn, buf, group=self.group.pg, tag=tag, group_peer=self.group.group_rank(peer)
        )

    def _report(self, timer: Timer, mismatched: set[Shard]) -> TransferReport:
        plan, rank = self.plan, self.rank
        messages = sum(
            len(r) for rounds in (*self._sends.values(), *self._recvs.values()) for r in rounds
        )
        return TransferReport(
            bytes_sent=sum(
                plan.item_bytes(i) for i in plan.items if i.src_rank == rank and not i.is_local
            ),
            bytes_received=sum(
                plan.item_bytes(i) for i in plan.items if i.dst_rank == rank and not i.is_local
            ),
            bytes_local=sum(
                plan.item_bytes(i) for i in plan.items if i.is_local and i.dst_rank == rank
            ),
            num_rounds=self.num_rounds,
            num_messages=messages,
            copy_s=timer.copy.total,
            wire_s=timer.wire.total,
            checksum_s=timer.checksum.total,
            first_post_s=timer.first_post or 0.0,
            posted_at=tuple(timer.posted),
            done_at=tuple(timer.done),
            mismatched=tuple(sorted(mismatched, key=lambda s: (s.tensor, s.region.offsets))),
        )
