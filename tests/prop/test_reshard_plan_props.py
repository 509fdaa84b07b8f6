"""plan_reshard against an element-by-element model of the same layouts.

Layouts are drawn at random: TP-like splits along any dimension with uneven cut points and
DP replicas, PP-like placement on a subset of ranks, flattened 1-D ranges (distributed
optimizer shards, several boxes per rank), and unions of two such layouts (overlapping,
non-identical sources). The test paints every tensor element by element with numpy and
derives the minimum bytes and the round-robin reference from the paint alone, never from
the planner's own figures.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dynarl.migrate import Region, Shard, TensorSpec, plan_reshard
from dynarl.migrate._region import flat_range_boxes

MAX_RANKS = 6
DTYPES = ["float32", "bfloat16", "int64", "uint8"]


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))


@st.composite
def cuts(draw: st.DrawFn, length: int, parts: int) -> list[int]:
    """Uneven split points of ``[0, length)`` into at most ``parts`` non-empty pieces."""
    inner = draw(st.sets(st.integers(1, max(1, length - 1)), max_size=parts - 1))
    return [0, *sorted(p for p in inner if 0 < p < length), length]


@st.composite
def tp_layout(draw: st.DrawFn, name: str, shape: tuple[int, ...]) -> list[Shard]:
    """Split along one dimension (uneven), each piece replicated on distinct ranks."""
    ranks = draw(st.permutations(range(MAX_RANKS)))
    if not shape:
        holders = ranks[: draw(st.integers(1, MAX_RANKS))]
        return [Shard(tensor=name, rank=r, region=Region(offsets=(), sizes=())) for r in holders]
    dim = draw(st.integers(0, len(shape) - 1))
    points = draw(cuts(shape[dim], 4))
    pieces = list(itertools.pairwise(points))
    replicas = draw(st.integers(1, max(1, MAX_RANKS // len(pieces))))
    out = []
    for i, (lo, hi) in enumerate(pieces):
        offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
        for j in range(replicas):
            rank = ranks[(i * replicas + j) % MAX_RANKS]
            out.append(Shard(tensor=name, rank=rank, region=Region(offsets=offsets, sizes=sizes)))
    return _dedupe(out)


@st.composite
def flat_layout(draw: st.DrawFn, name: str, shape: tuple[int, ...]) -> list[Shard]:
    """Contiguous flat ranges (distributed optimizer), each range as up to 2n-1 boxes."""
    numel = math.prod(shape)
    ranks = draw(st.permutations(range(MAX_RANKS)))
    points = draw(cuts(numel, MAX_RANKS))
    out = []
    for i, (lo, hi) in enumerate(itertools.pairwise(points)):
        out += [
            Shard(tensor=name, rank=ranks[i], region=box) for box in flat_range_boxes(shape, lo, hi)
        ]
    return out


@st.composite
def pp_layout(draw: st.DrawFn, name: str, shape: tuple[int, ...]) -> list[Shard]:
    """The whole tensor on one pipeline stage: a subset of ranks holding full copies."""
    holders = draw(st.sets(st.integers(0, MAX_RANKS - 1), min_size=1, max_size=3))
    full = Region(offsets=(0,) * len(shape), sizes=shape)
    return [Shard(tensor=name, rank=r, region=full) for r in sorted(holders)]


def _dedupe(shards: list[Shard]) -> list[Shard]:
    seen: dict[tuple[int, Region], Shard] = {}
    for s in shards:
        seen.setdefault((s.rank, s.region), s)
    return list(seen.values())


def _disjoint_per_rank(shards: list[Shard], shape: tuple[int, ...]) -> bool:
    paint: dict[int, np.ndarray] = defaultdict(lambda: np.zeros(shape, dtype=np.int32))
    for s in shards:
        paint[s.rank][s.region.slices()] += 1
    return all(int(p.max(initial=0)) <= 1 for p in paint.values())


@st.composite
def layout(draw: st.DrawFn, name: str, shape: tuple[int, ...], allow_union: bool) -> list[Shard]:
    kinds = [tp_layout, flat_layout, pp_layout]
    first = draw(draw(st.sampled_from(kinds))(name, shape))
    if allow_union and draw(st.booleans()):
        second = draw(draw(st.sampled_from(kinds))(name, shape))
        union = _dedupe(first + second)
        if _disjoint_per_rank(union, shape):
            return union
    return first


@st.composite
def problems(draw: st.DrawFn) -> tuple[dict[str, TensorSpec], list[Shard], list[Shard]]:
    num = draw(st.integers(1, 3))
    tensors: dict[str, TensorSpec] = {}
    src: list[Shard] = []
    dst: list[Shard] = []
    for i in range(num):
        name = f"t{i}"
        shape = draw(shapes())
        tensors[name] = TensorSpec(name=name, shape=shape, dtype=draw(st.sampled_from(DTYPES)))
        src += draw(layout(name, shape, allow_union=True))
        dst += draw(layout(name, shape, allow_union=True))
    order = draw(st.permutations(range(len(dst))))
    return tensors, src, [dst[i] for i in order]


def _held(src: list[Shard], spec: TensorSpec) -> dict[int, np.ndarray]:
    held: dict[int, np.ndarray] = defaultdict(lambda: np.zeros(spec.shape, dtype=bool))
    for s in src:
        if s.tensor == spec.name:
            held[s.rank][s.region.slices()] = True
    return held


def _reference(
    tensors: dict[str, TensorSpec], src: list[Shard], dst: list[Shard]
) -> tuple[int, int, int]:
    """Minimum bytes, local bytes and the round-robin busiest sender, element by element."""
    held = {name: _held(src, spec) for name, spec in tensors.items()}
    minimum = local = 0
    counters: dict[tuple[int, ...], int] = defaultdict(int)
    load: dict[int, int] = defaultdict(int)
    for shard in dst:
        spec = tensors[shard.tensor]
        granules: dict[tuple[int, ...], int] = defaultdict(int)
        for index in np.ndindex(*shard.region.sizes):
            element = tuple(o + i for o, i in zip(shard.region.offsets, index, strict=True))
            holders = tuple(r for r, mask in sorted(held[shard.tensor].items()) if mask[element])
            if shard.rank in holders:
                local += spec.itemsize
            else:
                minimum += spec.itemsize
                granules[holders] += spec.itemsize
        for holders in sorted(granules):
            sender = holders[counters[holders] % len(holders)]
            counters[holders] += 1
            load[sender] += granules[holders]
    return minimum, local, max(load.values(), default=0)


@given(problems())
def test_plan_tiles_reads_held_data_moves_minimum_and_spreads(
    problem: tuple[dict[str, TensorSpec], list[Shard], list[Shard]],
) -> None:
    tensors, src, dst = problem
    plan = plan_reshard(tensors, src, dst)
    held = {name: _held(src, spec) for name, spec in tensors.items()}
    # Every destination shard is tiled exactly once by the items that target it.
    for shard in dst:
        paint = np.zeros(shard.region.sizes, dtype=np.int32)
        for item in plan.items:
            if item.tensor == shard.tensor and item.dst_rank == shard.rank:
                cut = item.region.intersect(shard.region)
                if cut is not None:
                    assert shard.region.contains(item.region)
                    paint[cut.relative_to(shard.region).slices()] += 1
        assert (paint == 1).all(), (shard, paint)
    # No item reads data its source rank does not hold.
    for item in plan.items:
        assert held[item.tensor][item.src_rank][item.region.slices()].all(), item
    minimum, local, round_robin = _reference(tensors, src, dst)
    sent: dict[int, int] = defaultdict(int)
    for item in plan.items:
        if item.src_rank != item.dst_rank:
            sent[item.src_rank] += item.region.numel * tensors[item.tensor].itemsize
    assert plan.bytes_moved == minimum == sum(sent.values())
    assert plan.local_bytes == local
    assert plan.max_rank_send_bytes == max(sent.values(), default=0)
    assert plan.max_rank_send_bytes <= round_robin


@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_flat_range_boxes_are_the_range_in_order(
    shape_list: list[int], data: st.DataObject
) -> None:
    shape = tuple(shape_list)
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = flat_range_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    flat = np.arange(numel).reshape(shape)
    pieces = [flat[b.slices()].reshape(-1) for b in boxes]
    got = np.concatenate(pieces) if pieces else np.zeros(0, dtype=flat.dtype)
    assert got.tolist() == list(range(start, stop))
