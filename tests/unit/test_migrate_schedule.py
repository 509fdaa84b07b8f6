"""The message schedule on hand-made plans: what travels on its own, what is packed, cuts."""

from __future__ import annotations

import pytest

from dynarl.migrate import Region, Shard, TensorSpec, plan_reshard
from dynarl.migrate._schedule import Message, build_schedule, contiguous_within, piece_boxes

W = TensorSpec(name="w", shape=(8, 16), dtype="float32")  # 512 bytes


def region(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Region:
    return Region(offsets=offsets, sizes=sizes)


def shard(rank: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Shard:
    return Shard(tensor="w", rank=rank, region=region(offsets, sizes))


@pytest.mark.parametrize(
    ("inner", "outer", "expected"),
    [
        (((2, 0), (3, 16)), ((0, 0), (8, 16)), True),  # whole rows
        (((0, 0), (8, 8)), ((0, 0), (8, 16)), False),  # a column block
        (((3, 4), (1, 6)), ((0, 0), (8, 16)), True),  # part of one row
        (((0, 8), (8, 8)), ((0, 8), (8, 8)), True),  # the whole (strided-in-global) shard
        (((1, 0, 0), (1, 2, 5)), ((0, 0, 0), (4, 4, 5)), True),
        (((1, 0, 1), (1, 2, 4)), ((0, 0, 0), (4, 4, 5)), False),
        (((), ()), ((), ()), True),  # a scalar
    ],
)
def test_contiguous_within(
    inner: tuple[tuple[int, ...], tuple[int, ...]],
    outer: tuple[tuple[int, ...], tuple[int, ...]],
    expected: bool,
) -> None:
    assert contiguous_within(region(*inner), region(*outer)) is expected


def only(rounds: tuple[tuple[Message, ...], ...]) -> list[Message]:
    return [m for r in rounds for m in r]


def test_row_parallel_split_is_staged_at_the_source_only() -> None:
    # TP up along columns: rank 1 needs columns 4:8, held by rank 0 as part of its 0:8.
    src = [shard(0, (0, 0), (8, 8)), shard(1, (0, 8), (8, 8))]
    dst = [shard(r, (0, 4 * r), (8, 4)) for r in range(4)]
    plan = plan_reshard({"w": W}, src, dst)
    messages = only(build_schedule(plan, 0, chunk_bytes=1 << 20, direct_bytes=100).sends[1])
    assert [(m.direct, m.src_contiguous, m.dst_contiguous, m.nbytes) for m in messages] == [
        (True, False, True, 128)
    ]
    # One saved copy of 128 bytes is not worth a message at 200: packed instead.
    packed = only(build_schedule(plan, 0, chunk_bytes=1 << 20, direct_bytes=200).sends[1])
    assert [(m.direct, len(m.pieces)) for m in packed] == [(False, 1)]


def test_column_parallel_split_goes_in_place_and_is_cut_mid_row() -> None:
    src = [shard(0, (0, 0), (8, 16))]
    dst = [shard(1, (0, 0), (4, 16)), shard(2, (4, 0), (4, 16))]
    plan = plan_reshard({"w": W}, src, dst)
    sends = build_schedule(plan, 0, chunk_bytes=40, direct_bytes=1).sends
    pieces = [(m.pieces[0].start, m.pieces[0].stop) for m in only(sends[1])]
    assert pieces == [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 60), (60, 64)]
    assert all(m.direct and m.src_contiguous and m.dst_contiguous for m in only(sends[1]))
    # A piece cut mid-row spans a partial row, whole rows and a partial row.
    second = only(sends[1])[1].pieces[0]
    assert [str(b) for b in piece_boxes(second)] == ["[0:1, 10:16]", "[1:2, 0:4]"]
    recvs = build_schedule(plan, 1, chunk_bytes=40, direct_bytes=1).recvs[0]
    assert [m.pieces for m in only(recvs)] == [m.pieces for m in only(sends[1])]


def test_small_items_are_packed_aligned_across_rounds() -> None:
    byte = TensorSpec(name="b", shape=(13,), dtype="uint8")
    src = [Shard(tensor="b", rank=0, region=byte.full()), shard(0, (0, 0), (8, 16))]
    dst = [Shard(tensor="b", rank=1, region=byte.full()), shard(1, (0, 0), (1, 16))]
    plan = plan_reshard({"w": W, "b": byte}, src, dst)
    rounds = build_schedule(plan, 0, chunk_bytes=48, direct_bytes=1 << 20).sends[1]
    layout = [
        [(p.item.tensor, p.start, p.stop, p.offset) for m in r for p in m.pieces] for r in rounds
    ]
    # 13 bytes of "b", then 64 of "w" from offset 16 (8-aligned): split at 48-byte rounds.
    assert layout == [[("b", 0, 13, 0), ("w", 0, 8, 16)], [("w", 8, 16, 0)]]
