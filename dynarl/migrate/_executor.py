"""Carry a ReshardPlan out over torch.distributed: batched isend/irecv, bounded memory.

Every rank of the plan builds a :class:`PlanExecutor` with the same plan and a group over
the plan's ranks. :meth:`PlanExecutor.prepare` (before the trainer pauses) derives the
message schedule from the plan alone (:mod:`._schedule`: both ends agree without exchanging
sizes), allocates and touches the staging buffers, and warms every connection up with a
small exchange (transports set connections up lazily). :meth:`PlanExecutor.run` (during the
pause) sends in rounds of at most ``chunk_bytes`` per peer and direction. A direct message
travels straight from the source shard and into the destination shard where those views
are contiguous (through a staging buffer otherwise); packed messages gather small items.
Each round packs what needs packing, posts its receives and sends as one
``batch_isend_irecv`` (one NCCL group on CUDA), waits with an explicit timeout, then
unpacks. Gloo (CPU) and NCCL (CUDA) take the same path. With
``verify``, every remote piece is checksummed (CRC-32 on CPU, a device-side weighted sum on
CUDA) at the source, from the bytes read there, and at the destination, from the bytes read
back there; source checksums follow in a last message per peer. Local copies are compared
bitwise. Mismatching destination shards are reported.

Runs on every rank of the plan, in the trainer's thread; blocks until done or timed out.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynarl.migrate._groups import CommGroup
from dynarl.migrate._region import Shard
from dynarl.migrate._reshard_plan import ReshardPlan, Transfer
from dynarl.migrate._schedule import ALIGN, Message, Piece, build_schedule, piece_boxes
from dynarl.migrate._staging import (
    Timer,
    TransferReport,
    ViewIndex,
    as_bytes,
    checksum,
    device_of,
    index_device,
    int64_tensor,
    locate,
    post,
    region_view,
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
    """An item travels as its own message when its bytes, times the copies that saves (one
    per end where it is contiguous in its shard), reach this; smaller ones are packed."""
    timeout_s: float = 60.0
    """Deadline of every wait on the network, seconds."""
    verify: bool = True
    """Checksum remote pieces at both ends and compare local copies bitwise."""
    checksum_threads: int = 2
    """Threads computing checksums (CRC-32 releases the GIL) and, on CPU, the local copies."""
    background_nice: int = 10
    """On CPU, how much lower (Linux thread niceness) the priority of the threads that
    checksum and copy locally is, so that transport threads get busy cores first; 0 keeps
    them at the caller's."""
    warmup_bytes: int = 64 << 10
    """Bytes :meth:`PlanExecutor.prepare` exchanges with each peer (per direction the plan
    uses, at most what the plan sends there) so that the transport's lazy setup (NCCL's
    communicator and per-peer connections) happens before the pause; 0 skips it (prepare
    then does not communicate)."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < ALIGN or self.direct_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= {ALIGN} and direct_bytes >= 1")
        if self.timeout_s <= 0 or self.checksum_threads < 1 or self.warmup_bytes < 0:
            raise ValueError("timeout_s must be > 0, checksum_threads >= 1, warmup_bytes >= 0")
        if not 0 <= self.background_nice <= 19:
            raise ValueError(f"background_nice must be in [0, 19], got {self.background_nice}")


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
        self.schedule = build_schedule(
            plan,
            rank,
            chunk_bytes=self.config.chunk_bytes,
            direct_bytes=self.config.direct_bytes,
        )
        if (self.schedule.sends or self.schedule.recvs) and group is None:
            raise ValueError(f"rank {rank} has remote transfers but no group was given")
        self.num_rounds = self.schedule.num_rounds
        self._local = [i for i in plan.items if i.is_local and i.dst_rank == rank]
        self._dst: ViewIndex = {}
        self._buffers: dict[Message, torch.Tensor] = {}

    def prepare(
        self,
        destinations: Mapping[Shard, torch.Tensor],
        sources: Mapping[Shard, torch.Tensor] | None = None,
    ) -> None:
        """Index the destination views, allocate (and touch) the staging buffers, and warm
        the connections up (see ``ExecutorConfig.warmup_bytes``).

        ``sources``, when given, lets large non-contiguous sends be staged now too (their
        views are looked up again at :meth:`run`). Runs before the pause, on every rank of
        the plan at about the same time (the warm-up waits for the peers, at most
        ``timeout_s``). Raises ValueError for a missing or misshaped view, MigrationError
        when the warm-up fails.
        """
        self._dst = view_index(self.plan.dst, destinations, self.rank, "destination")
        src = view_index(self.plan.src, sources, self.rank, "source") if sources else None
        device = device_of(destinations) if destinations else device_of(sources or {})
        schedule, rounds = self.schedule, range(self.num_rounds)
        for message in (m for i in rounds for m in schedule.round(i, outgoing=False)):
            if not message.direct or self._flat(self._dst, message.pieces[0]) is None:
                self._buffers[message] = torch.zeros(
                    message.nbytes, dtype=torch.uint8, device=device
                )
        for message in (m for i in rounds for m in schedule.round(i, outgoing=True)):
            staged = src is not None and self._flat(src, message.pieces[0]) is None
            if not message.direct or staged:
                self._buffers[message] = torch.zeros(
                    message.nbytes, dtype=torch.uint8, device=device
                )
        if self.config.warmup_bytes:
            self._warm_up(device)

    def _warm_up(self, device: torch.device) -> None:
        """Exchange up to ``warmup_bytes`` with every peer, in each direction the plan uses.

        NCCL creates a group's communicator and connects each pair on first use; without
        this the first round of the pause pays for it. Gloo connects when the group is built
        (warming its sockets up with more data did not measurably speed the pause up).
        """
        sizes = {
            (outgoing, peer): min(
                self.config.warmup_bytes, sum(m.nbytes for r in rounds for m in r)
            )
            for outgoing, table in ((True, self.schedule.sends), (False, self.schedule.recvs))
            for peer, rounds in table.items()
        }
        ops = [
            self._op(
                dist.isend if outgoing else dist.irecv,
                torch.zeros(n, dtype=torch.uint8, device=device),
                peer,
                0,
            )
            for (outgoing, peer), n in sorted(sizes.items(), key=lambda kv: kv[0][0])
        ]
        wait(post(ops, "warm-up"), self.config.timeout_s, "warm-up")

    def run(self, sources: Mapping[Shard, torch.Tensor]) -> TransferReport:
        """Move the data (the old state is only read). Raises MigrationError when a wait
        exceeds the timeout or the transport fails; destinations may then hold partial data."""
        src = view_index(self.plan.src, sources, self.rank, "source")
        timer = Timer()
        mismatched: set[Shard] = set()
        local = self._local
        cuda = (index_device(src) if src else index_device(self._dst)).type == "cuda"

        def copy_local() -> None:
            with timer.copy:
                for item in local:
                    region_view(self._dst, item, item.region).copy_(
                        region_view(src, item, item.region)
                    )

        # On CPU the checksums and local copies run in threads of lower priority: on busy
        # cores they would otherwise slow the transport threads of ranks still receiving.
        nice = 0 if cuda else self.config.background_nice
        with ThreadPoolExecutor(
            self.config.checksum_threads, initializer=functools.partial(_lower_priority, nice)
        ) as pool:
            sums = _Sums()
            # On CUDA local copies overlap the first round; on CPU they follow the rounds
            # (a memcpy and the loopback transport would compete for the same cores).
            overlap = cuda and self.num_rounds > 0
            for index in range(self.num_rounds):
                meanwhile = copy_local if overlap and index == 0 else None
                self._round(index, src, pool, timer, sums, cuda=cuda, meanwhile=meanwhile)
            copied = None if overlap else pool.submit(copy_local)
            if self.config.verify:
                with timer.checksum:
                    mismatched |= self._exchange_checksums(sums)
            if copied is not None:
                copied.result()
            if self.config.verify:
                with timer.checksum:
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
        sums: _Sums,
        *,
        cuda: bool,
        meanwhile: Callable[[], None] | None,
    ) -> None:
        """Pack, post the round as one batch (receives first), run ``meanwhile``, wait,
        unpack, checksum.

        One batch per round: NCCL needs a round's sends and receives in one group, and on
        CPU posting while still packing, or unpacking while still receiving, gains nothing
        measurable (the copies compete with the loopback transport for the same cores;
        gloo even writes a send inside the posting call when its receive is posted).
        Source checksums overlap the transfer on CUDA (device work beside the NCCL DMA); on
        CPU they follow it, for the same reason.
        """
        incoming = self.schedule.round(index, outgoing=False)
        outgoing = self.schedule.round(index, outgoing=True)
        what = f"round {index}"
        with timer.copy:
            ops = [self._op(dist.irecv, self._incoming(m), m.peer, m.tag) for m in incoming]
            ops += [self._op(dist.isend, self._outgoing(src, m), m.peer, m.tag) for m in outgoing]
        posted = time.perf_counter()
        timer.first_post = timer.first_post or posted - timer.start
        timer.ready.append(time.monotonic())
        works = post(ops, what)
        overlap = self.config.verify and cuda
        pending = self._sum_sources(pool, src, outgoing) if overlap else []
        if meanwhile is not None:
            meanwhile()
        wait(works, self.config.timeout_s, what)
        timer.done.append(time.monotonic())
        timer.wire.total += time.perf_counter() - posted  # this rank's post to completion
        with timer.copy:
            for message in incoming:
                self._unpack(message)
        if not self.config.verify:
            return
        with timer.checksum:
            if not overlap:
                pending = self._sum_sources(pool, src, outgoing)
            pieces = [p for m in incoming for p in m.pieces]
            sums.got += zip(pieces, pool.map(self._sum_destination, pieces), strict=True)
            for peer, future in pending:
                sums.sent[peer].append(future.result())

    def _sum_sources(
        self, pool: ThreadPoolExecutor, src: ViewIndex, outgoing: list[Message]
    ) -> list[tuple[int, Future[int]]]:
        return [
            (message.peer, pool.submit(self._sum_source, src, message, piece))
            for message in outgoing
            for piece in message.pieces
        ]

    def _incoming(self, message: Message) -> torch.Tensor:
        """Where a message is received: its staging buffer, or the destination in place."""
        target = self._buffers.get(message)
        if target is None:
            target = self._flat(self._dst, message.pieces[0])
        assert target is not None
        return target

    def _outgoing(self, src: ViewIndex, message: Message) -> torch.Tensor:
        """What a message sends: its source in place when contiguous, else packed."""
        if message.direct and message not in self._buffers:
            view = self._flat(src, message.pieces[0])
            if view is not None:
                return view
        return self._pack(src, message)

    def _pack(self, src: ViewIndex, message: Message) -> torch.Tensor:
        buffer = self._buffers.get(message)
        if buffer is None:
            buffer = torch.empty(message.nbytes, dtype=torch.uint8, device=index_device(src))
            self._buffers[message] = buffer
        for piece in message.pieces:
            self._copy_piece(src, piece, buffer, to_buffer=True)
        return buffer

    def _unpack(self, message: Message) -> None:
        buffer = self._buffers.get(message)
        if buffer is not None:
            for piece in message.pieces:
                self._copy_piece(self._dst, piece, buffer, to_buffer=False)

    def _copy_piece(
        self, index: ViewIndex, piece: Piece, buffer: torch.Tensor, *, to_buffer: bool
    ) -> None:
        """Copy a piece between its shard and its place in ``buffer``: one flat copy when the
        item is contiguous in the shard, box by box otherwise."""
        flat = self._flat(index, piece)
        if flat is not None:
            pairs = [(buffer[piece.offset : piece.offset + piece.nbytes], flat)]
        else:
            pairs, offset = [], piece.offset
            for box in piece_boxes(piece):
                staged = self._typed(buffer, offset, piece.item.tensor, box.sizes)
                pairs.append((staged, region_view(index, piece.item, box)))
                offset += staged.numel() * staged.element_size()
        for staged, view in pairs:
            if to_buffer:
                staged.copy_(view)
            else:
                view.copy_(staged)

    def _typed(
        self, buf: torch.Tensor, offset: int, tensor: str, sizes: tuple[int, ...]
    ) -> torch.Tensor:
        nbytes = self._itemsize[tensor] * torch.Size(sizes).numel()
        return buf[offset : offset + nbytes].view(self._dtype[tensor]).view(sizes)

    def _flat(self, index: ViewIndex, piece: Piece) -> torch.Tensor | None:
        """The piece as a 1-D byte view of its shard, when the item's view is contiguous."""
        view = region_view(index, piece.item, piece.item.region)
        if not view.is_contiguous():
            return None
        size = self._itemsize[piece.item.tensor]
        return as_bytes(view)[piece.start * size : piece.stop * size]

    def _sum_source(self, src: ViewIndex, message: Message, piece: Piece) -> int:
        buffer = self._buffers.get(message)
        if buffer is None:
            view = self._flat(src, piece)
            assert view is not None
            return checksum(view)
        return checksum(buffer[piece.offset : piece.offset + piece.nbytes])

    def _sum_destination(self, piece: Piece) -> int:
        flat = self._flat(self._dst, piece)
        if flat is not None:
            return checksum(flat)
        parts = [
            as_bytes(region_view(self._dst, piece.item, box).contiguous())
            for box in piece_boxes(piece)
        ]
        return checksum(torch.cat(parts) if len(parts) > 1 else parts[0])

    def _local_differs(self, src: ViewIndex, item: Transfer) -> Shard | None:
        a = as_bytes(region_view(src, item, item.region).contiguous())
        b = as_bytes(region_view(self._dst, item, item.region).contiguous())
        return None if torch.equal(a, b) else locate(self._dst, item.tensor, item.region)[2]

    def _exchange_checksums(self, sums: _Sums) -> set[Shard]:
        device = index_device(self._dst)
        by_peer: dict[int, list[tuple[Piece, int]]] = defaultdict(list)
        for piece, value in sums.got:
            by_peer[piece.item.src_rank].append((piece, value))
        received = {
            p: torch.empty(len(v), dtype=torch.int64, device=device) for p, v in by_peer.items()
        }
        ops = [self._op(dist.isend, int64_tensor(v, device), p, 0) for p, v in sums.sent.items()]
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
            num_messages=self.schedule.num_messages,
            copy_s=timer.copy.total,
            wire_s=timer.wire.total,
            checksum_s=timer.checksum.total,
            first_post_s=timer.first_post or 0.0,
            ready_at=tuple(timer.ready),
            done_at=tuple(timer.done),
            mismatched=tuple(sorted(mismatched, key=lambda s: (s.tensor, s.region.offsets))),
        )


def _lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness by ``nice`` (Linux: per thread; elsewhere the
    call would renice the whole process, so it does nothing)."""
    if nice and sys.platform == "linux":
        current = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, min(19, current + nice))


class _Sums:
    """Checksums gathered over the rounds: sent per peer, and received per piece."""

    def __init__(self) -> None:
        self.sent: dict[int, list[int]] = defaultdict(list)
        self.got: list[tuple[Piece, int]] = []
