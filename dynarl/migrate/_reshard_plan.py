"""plan_reshard: the pure function that decides which bytes move between which ranks.

Given the shards every rank holds now (``src``) and the shards every rank must hold after
the move (``dst``), :func:`plan_reshard` returns frozen :class:`Transfer` items that

- tile every destination shard exactly once (destination regions never overlap, and they
  cover the shard);
- read only data their source rank holds;
- move the minimum number of bytes: an element a destination rank already holds is copied
  locally and never crosses ranks;
- spread the sends over replicas: elements held by several ranks are fetched from the
  holders so that the busiest sender sends no more than under the round-robin reference
  (see :func:`_assign_senders`).

Pure and synchronous; no torch. Runs on the controller (to cost a move) and on every rank
(each computes the same plan from the same layouts).
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dynarl.migrate._region import (
    Box,
    Region,
    Shard,
    TensorSpec,
    box_difference,
    box_numel,
    intersect_boxes,
)

__all__ = ["ReshardPlan", "Transfer", "plan_reshard"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """Copy ``region`` of ``tensor`` from ``src_rank`` to ``dst_rank`` (local when equal)."""

    tensor: str
    """Name of the tensor."""
    src_rank: int
    """Rank that reads the data from one of its source shards."""
    dst_rank: int
    """Rank that writes it into one of its destination shards."""
    region: Region
    """The box, in the tensor's global coordinates."""

    @property
    def is_local(self) -> bool:
        """Whether the copy stays on one rank."""
        return self.src_rank == self.dst_rank


@dataclass(frozen=True, kw_only=True, slots=True)
class ReshardPlan:
    """Everything needed to carry a reshard out, and what it costs."""

    tensors: tuple[TensorSpec, ...]
    """Specs of the tensors the plan touches, sorted by name."""
    src: tuple[Shard, ...]
    """Shards held before the move."""
    dst: tuple[Shard, ...]
    """Shards held after the move."""
    items: tuple[Transfer, ...]
    """Copies to perform, grouped by tensor, in destination-shard order."""
    bytes_moved: int
    """Bytes crossing ranks (the minimum possible for these layouts)."""
    local_bytes: int
    """Bytes copied within a rank."""
    max_rank_send_bytes: int
    """Bytes sent by the busiest sending rank."""
    by_name: dict[str, TensorSpec] = field(init=False, repr=False, compare=False)
    """``tensors`` by name (derived)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {t.name: t for t in self.tensors})

    def spec(self, name: str) -> TensorSpec:
        """The spec of tensor ``name``; raises KeyError if the plan does not touch it."""
        return self.by_name[name]

    def item_bytes(self, item: Transfer) -> int:
        """Bytes carried by ``item``."""
        return item.region.numel * self.spec(item.tensor).itemsize

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that holds a source or a destination shard, sorted."""
        return tuple(sorted({s.rank for s in self.src} | {s.rank for s in self.dst}))

    def send_bytes_by_rank(self) -> dict[int, int]:
        """Bytes each rank sends to other ranks."""
        out: dict[int, int] = defaultdict(int)
        for item in self.items:
            if not item.is_local:
                out[item.src_rank] += self.item_bytes(item)
        return dict(out)


@dataclass(slots=True)
class _Granule:
    """The remote part of one destination shard that one holder set can serve."""

    order: int
    dst_rank: int
    tensor: str
    holders: tuple[int, ...]
    regions: list[Region]
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Answer:
    """One atom's part of a destination box: where, as a Region, and who holds it."""

    box: Box
    region: Region
    holders: tuple[int, ...]
    holder_set: frozenset[int]


def plan_reshard(
    tensors: Mapping[str, TensorSpec], src: Sequence[Shard], dst: Sequence[Shard]
) -> ReshardPlan:
    """Plan moving the trainer state from layout ``src`` to layout ``dst``.

    Raises ValueError naming the tensor and region for: a shard of an unknown tensor, a
    region outside its tensor, two destination shards of one tensor overlapping on one
    rank, two source shards of one tensor overlapping on one rank, and a destination
    region that no source shard holds.
    """
    _check_shards(tensors, src, "source")
    _check_shards(tensors, dst, "destination")
    src_by = _by_tensor(src)
    dst_by = _by_tensor(dst)
    indexes: dict[str, _AtomIndex] = {}
    for name, dst_shards in dst_by.items():
        _check_disjoint_per_rank(name, dst_shards, "destination")
        _check_disjoint_per_rank(name, src_by.get(name, []), "source")
        indexes[name] = _AtomIndex(_source_atoms(src_by.get(name, [])))
    local: list[tuple[int, Transfer]] = []
    granules: list[_Granule] = []
    # DP replicas ask for the same boxes: answer each distinct (tensor, box) once.
    answers: dict[tuple[str, Box], tuple[list[_Answer], int]] = {}
    for order, shard in enumerate(dst):
        if shard.region.numel == 0:
            continue
        name = shard.tensor
        key = (name, shard.region.box)
        if key not in answers:
            pieces = indexes[name].query(shard.region.box)
            found = [_Answer(b, Region.from_box(b), h, frozenset(h)) for b, h in pieces]
            answers[key] = found, sum(box_numel(b) for b, _ in pieces)
        found, covered = answers[key]
        if covered != shard.region.numel:
            _raise_uncovered(name, shard, indexes[name])
        remote: dict[tuple[int, ...], list[_Answer]] = {}
        for answer in found:
            if shard.rank in answer.holder_set:
                item = Transfer(
                    tensor=name, src_rank=shard.rank, dst_rank=shard.rank, region=answer.region
                )
                local.append((order, item))
            else:
                remote.setdefault(answer.holders, []).append(answer)
        itemsize = tensors[name].itemsize
        for holders in sorted(remote):
            parts = remote[holders]
            nbytes = sum(a.region.numel for a in parts) * itemsize
            granules.append(
                _Granule(order, shard.rank, name, holders, [a.region for a in parts], nbytes)
            )
    senders = _assign_senders(granules)
    items = _ordered_items(local, granules, senders)
    used = sorted({item.tensor for item in items} | set(dst_by))
    plan = ReshardPlan(
        tensors=tuple(tensors[n] for n in used),
        src=tuple(src),
        dst=tuple(dst),
        items=items,
        bytes_moved=sum(g.nbytes for g in granules),
        local_bytes=sum(i.region.numel * tensors[i.tensor].itemsize for _, i in local),
        max_rank_send_bytes=max(_loads(granules, senders).values(), default=0),
    )
    logger.debug(
        "planned reshard: %d items, %d bytes moved, %d local",
        len(items),
        plan.bytes_moved,
        plan.local_bytes,
    )
    return plan


def _ordered_items(
    local: list[tuple[int, Transfer]], granules: list[_Granule], senders: list[int]
) -> tuple[Transfer, ...]:
    keyed: list[tuple[int, int, Transfer]] = [(o, 0, t) for o, t in local]
    for granule, sender in zip(granules, senders, strict=True):
        for region in granule.regions:
            item = Transfer(
                tensor=granule.tensor, src_rank=sender, dst_rank=granule.dst_rank, region=region
            )
            keyed.append((granule.order, 1, item))
    keyed.sort(key=lambda k: (k[0], k[1], k[2].region.offsets))
    return tuple(t for _, _, t in keyed)


def _assign_senders(granules: list[_Granule]) -> list[int]:
    """Choose a sender for every granule; never worse than the round-robin reference.

    The reference, round-robin: granules in order (destination shards in input order, then
    holder sets sorted), each given to ``holders[count[holders] % len(holders)]`` with one
    counter per holder set. The alternative, largest-first: granules by decreasing size,
    each to its least-loaded holder. The one with the smaller busiest sender wins (ties: the
    round-robin one, which keeps consecutive destinations on distinct senders).
    """
    counters: dict[tuple[int, ...], int] = defaultdict(int)
    round_robin: list[int] = []
    for g in granules:
        round_robin.append(g.holders[counters[g.holders] % len(g.holders)])
        counters[g.holders] += 1
    load: dict[int, int] = defaultdict(int)
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    greedy = [0] * len(granules)
    for i in sorted(range(len(granules)), key=lambda i: (-granules[i].nbytes, i)):
        holders = granules[i].holders
        heap = heaps.get(holders)
        if heap is None:
            heap = heaps[holders] = [(0, r) for r in holders]
        # Lazy heap: an entry is stale when another holder set has loaded that rank since.
        while heap[0][0] != load[heap[0][1]]:
            _, rank = heapq.heappop(heap)
            heapq.heappush(heap, (load[rank], rank))
        _, best = heapq.heappop(heap)
        greedy[i] = best
        load[best] += granules[i].nbytes
        heapq.heappush(heap, (load[best], best))
    rr_max = max(_loads(granules, round_robin).values(), default=0)
    greedy_max = max(load.values(), default=0)
    return greedy if greedy_max < rr_max else round_robin


def _loads(granules: list[_Granule], senders: list[int]) -> dict[int, int]:
    load: dict[int, int] = defaultdict(int)
    for g, s in zip(granules, senders, strict=True):
        load[s] += g.nbytes
    return load


def _by_tensor(shards: Sequence[Shard]) -> dict[str, list[Shard]]:
    out: dict[str, list[Shard]] = {}
    for shard in shards:
        out.setdefault(shard.tensor, []).append(shard)
    return out


def _check_shards(tensors: Mapping[str, TensorSpec], shards: Sequence[Shard], side: str) -> None:
    for shard in shards:
        spec = tensors.get(shard.tensor)
        if spec is None:
            raise ValueError(
                f"{side} shard of unknown tensor {shard.tensor!r} (region {shard.region}, "
                f"rank {shard.rank})"
            )
        if not shard.region.fits(spec.shape):
            raise ValueError(
                f"{side} region {shard.region} of tensor {shard.tensor!r} on rank {shard.rank} "
                f"is outside its shape {spec.shape}"
            )


def _check_disjoint_per_rank(name: str, shards: Sequence[Shard], side: str) -> None:
    by_rank: dict[int, list[Shard]] = {}
    for shard in shards:
        by_rank.setdefault(shard.rank, []).append(shard)
    for rank, mine in by_rank.items():
        if len(mine) < 2:
            continue
        clash = _first_overlap([s.region.box for s in mine])
        if clash is not None:
            a, b = (Region.from_box(x) for x in clash)
            raise ValueError(
                f"{side} shards of tensor {name!r} overlap on rank {rank}: regions {a} and {b}"
            )


def _first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two overlapping boxes, found by a sweep along the most spread dimension, or None."""
    if boxes and not boxes[0][0]:
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None
    dim = _spread_dim(boxes)
    active: list[Box] = []
    for box in sorted(boxes, key=lambda b: b[0][dim]):
        active = [a for a in active if a[1][dim] > box[0][dim]]
        for other in active:
            if intersect_boxes(box, other) is not None:
                return other, box
        active.append(box)
    return None


def _source_atoms(shards: Sequence[Shard]) -> list[tuple[Box, tuple[int, ...]]]:
    """Split the union of the source regions into disjoint boxes, each with its holders.

    Replicas (identical regions) collapse into one box held by several ranks. When distinct
    regions overlap, they are refined by guillotine cuts so that every atom lies either
    inside or outside each source region.
    """
    holders: dict[Box, set[int]] = {}
    for shard in shards:
        if shard.region.numel:
            holders.setdefault(shard.region.box, set()).add(shard.rank)
    boxes = list(holders)
    if _first_overlap(boxes) is None:
        return [(b, tuple(sorted(holders[b]))) for b in boxes]
    atoms: list[tuple[Box, frozenset[int]]] = []
    for box in boxes:
        ranks = frozenset(holders[box])
        pending = [box]
        refined: list[tuple[Box, frozenset[int]]] = []
        for atom, owners in atoms:
            cut = intersect_boxes(atom, box)
            if cut is None:
                refined.append((atom, owners))
                continue
            refined.append((cut, owners | ranks))
            refined.extend((piece, owners) for piece in box_difference(atom, cut))
            pending = [p for rest in pending for p in box_difference(rest, cut)]
        refined.extend((p, ranks) for p in pending)
        atoms = refined
    return [(b, tuple(sorted(r))) for b, r in atoms]


def _spread_dim(boxes: Sequence[Box]) -> int:
    """The dimension along which the boxes' lower corners take the most distinct values."""
    ndim = len(boxes[0][0]) if boxes else 0
    return max(range(ndim), key=lambda d: len({b[0][d] for b in boxes}), default=-1)


class _AtomIndex:
    """Disjoint boxes sorted along their most spread dimension, for overlap queries."""

    def __init__(self, atoms: list[tuple[Box, tuple[int, ...]]]) -> None:
        self.dim = _spread_dim([a[0] for a in atoms])
        dim = self.dim
        self.atoms = sorted(atoms, key=lambda a: a[0][0][dim]) if dim >= 0 else atoms
        self.starts = [a[0][0][dim] for a in self.atoms] if dim >= 0 else []
        self.reach = max((a[0][1][dim] - a[0][0][dim] for a in atoms), default=0) if dim >= 0 else 0

    def query(self, box: Box) -> list[tuple[Box, tuple[int, ...]]]:
        """Pieces of ``box`` inside each atom that overlaps it, with the atom's holders."""
        if self.dim < 0:
            candidates = self.atoms
        else:
            lo = bisect.bisect_right(self.starts, box[0][self.dim] - self.reach)
            hi = bisect.bisect_left(self.starts, box[1][self.dim])
            candidates = self.atoms[lo:hi]
        out = []
        for atom, holders in candidates:
            cut = intersect_boxes(atom, box)
            if cut is not None:
                out.append((cut, holders))
        return out


def _raise_uncovered(name: str, shard: Shard, index: _AtomIndex) -> None:
    rest = [shard.region.box]
    for box, _ in index.query(shard.region.box):
        rest = [p for r in rest for p in box_difference(r, box)]
    hole = Region.from_box(rest[0])
    raise ValueError(
        f"destination region {shard.region} of tensor {shard.tensor!r} on rank {shard.rank} "
        f"is not held by any source shard (for instance {hole})"
    )
