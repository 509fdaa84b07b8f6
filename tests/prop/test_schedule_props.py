"""The message schedule against the plan it carries out.

Both ends of every pair must derive the same messages; the pieces must tile every remote
item exactly once, byte-aligned and inside their messages; rounds must respect
``chunk_bytes``; and an item travels on its own exactly when the copies that saves, judged
element by element here from the shards' row-major layout, are worth ``direct_bytes``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from test_reshard_plan_props import problems

from dynarl.migrate import Region, Shard, TensorSpec, Transfer, plan_reshard
from dynarl.migrate._schedule import ALIGN, Message, Schedule, build_schedule


def _contiguous(region: Region, shards: list[Shard]) -> bool:
    """Whether ``region`` is one run of consecutive elements of the shard holding it."""
    outer = next(s.region for s in shards if s.region.contains(region))
    flat = np.arange(outer.numel).reshape(outer.sizes)[region.relative_to(outer).slices()]
    return bool((np.diff(flat.reshape(-1)) == 1).all())


def _describe(messages: tuple[tuple[Message, ...], ...]) -> list[list[tuple[object, ...]]]:
    return [
        [(m.tag, m.direct, m.nbytes, [(p.item, p.start, p.stop, p.offset) for p in m.pieces])]
        for r in messages
        for m in r
    ]


@given(problems(), st.sampled_from([8, 24, 64, 1 << 20]), st.sampled_from([1, 16, 48, 1 << 30]))
def test_schedules_agree_tile_items_and_respect_sizes(
    problem: tuple[dict[str, TensorSpec], list[Shard], list[Shard]], chunk: int, direct: int
) -> None:
    tensors, src, dst = problem
    plan = plan_reshard(tensors, src, dst)
    ranks = sorted({s.rank for s in src} | {s.rank for s in dst})
    schedules: dict[int, Schedule] = {
        r: build_schedule(plan, r, chunk_bytes=chunk, direct_bytes=direct) for r in ranks
    }
    holders: dict[tuple[bool, str, int], list[Shard]] = defaultdict(list)
    for is_src, side in ((True, src), (False, dst)):
        for shard in side:
            holders[is_src, shard.tensor, shard.rank].append(shard)
    covered: dict[Transfer, list[tuple[int, int]]] = defaultdict(list)
    for rank, schedule in schedules.items():
        for peer, rounds in schedule.sends.items():
            assert _describe(rounds) == _describe(schedules[peer].recvs[rank])
            tags = [m.tag for r in rounds for m in r]
            assert len(set(tags)) == len(tags)
            for messages in rounds:
                assert sum(m.nbytes for m in messages) <= chunk
                for message in messages:
                    _check_message(message, tensors, holders, direct)
                    for piece in message.pieces:
                        covered[piece.item].append((piece.start, piece.stop))
    remote = [i for i in plan.items if not i.is_local]
    assert sorted(covered, key=repr) == sorted(remote, key=repr)
    for item, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == item.region.numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def _check_message(
    message: Message,
    tensors: dict[str, TensorSpec],
    holders: dict[tuple[bool, str, int], list[Shard]],
    direct: int,
) -> None:
    ends = []
    for piece in message.pieces:
        size = tensors[piece.item.tensor].itemsize
        assert piece.offset % ALIGN == 0 and piece.nbytes == (piece.stop - piece.start) * size
        assert 0 <= piece.start < piece.stop <= piece.item.region.numel
        ends.append((piece.offset, piece.offset + piece.nbytes))
    ends.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))
    assert ends[-1][1] == message.nbytes
    for piece in message.pieces:
        item = piece.item
        src_ok = _contiguous(item.region, holders[True, item.tensor, item.src_rank])
        dst_ok = _contiguous(item.region, holders[False, item.tensor, item.dst_rank])
        saved = int(src_ok) + int(dst_ok)
        worth = saved > 0 and item.region.numel * tensors[item.tensor].itemsize * saved >= direct
        assert message.direct == worth
        if message.direct:
            assert len(message.pieces) == 1
            assert (message.src_contiguous, message.dst_contiguous) == (src_ok, dst_ok)
