"""execute_plan over gloo, 4 processes: layouts rebuilt bitwise, checksums, timeouts.

Each case builds two trainer layouts of a small GPT-shaped model, fills every source shard
from a seeded global tensor, runs the plan over a group built from a PrefixStore (only the
plan's ranks take part), and compares every destination shard bitwise with the global
tensor. Small ``chunk_bytes`` force many rounds and pieces that split items.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dynarl.errors import MigrationError
from dynarl.migrate import (
    Layout,
    LayoutSpec,
    ParamSpec,
    Region,
    Shard,
    Stage,
    TensorSpec,
    plan_reshard,
    trainer_layout,
)
from dynarl.migrate._executor import ExecutorConfig, PlanExecutor, checksum, execute_plan
from dynarl.migrate._groups import CommGroup, build_group

pytestmark = pytest.mark.dist
WORLD = 4


def model() -> list[ParamSpec]:
    h, f, vocab = 8, 16, 16
    params = [ParamSpec(name="emb", shape=(vocab, h), tp_dim=0, stage=Stage.FIRST)]
    for n in range(2):
        params += [
            ParamSpec(name=f"l{n}.norm", shape=(h,), layer=n),
            ParamSpec(name=f"l{n}.qkv", shape=(3 * h, h), tp_dim=0, layer=n),
            ParamSpec(name=f"l{n}.fc1", shape=(2 * f, h), tp_dim=0, tp_stride=2, layer=n),
            ParamSpec(name=f"l{n}.fc2", shape=(h, f), tp_dim=1, layer=n),
        ]
    return [*params, ParamSpec(name="out", shape=(vocab, h), tp_dim=0, stage=Stage.LAST)]


def spec(ranks: tuple[int, ...], tp: int, pp: int = 1, **kw: Any) -> LayoutSpec:
    return LayoutSpec(ranks=ranks, tp=tp, pp=pp, dp=len(ranks) // (tp * pp), **kw)


CASES = [
    (spec((0, 1, 2, 3), 2), spec((0, 1, 2, 3), 4), 1 << 20, 1 << 20),
    (spec((0, 1, 2, 3), 4), spec((2, 3, 0, 1), 2), 96, 1 << 20),
    (spec((0, 1, 2, 3), 2, distributed_optimizer=True), spec((0, 1), 1), 64, 1 << 20),
    (spec((0, 1), 1), spec((0, 1, 2, 3), 1, pp=2, distributed_optimizer=True), 1 << 20, 1 << 20),
    (
        spec((0, 1, 2, 3), 2, param_dtype="bfloat16", master_dtype="float32"),
        spec(
            (3, 2, 1, 0),
            1,
            distributed_optimizer=True,
            param_dtype="bfloat16",
            master_dtype="float32",
            bucket_size=50,
        ),
        40,
        1 << 20,
    ),
    # Items of 64 bytes and more travel as their own messages: straight from and into
    # contiguous views, staged for strided ones (TP splits along dim 1), cut at 200 bytes.
    (spec((0, 1, 2, 3), 2), spec((3, 2, 1, 0), 4), 200, 64),
    (spec((0, 1, 2, 3), 4), spec((0, 1, 2, 3), 1, pp=2, distributed_optimizer=True), 1 << 20, 64),
]


def global_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(spec.shape, generator=gen).to(getattr(torch, spec.dtype))


def locals_for(
    layout: Layout, rank: int, fill: dict[str, torch.Tensor] | None
) -> tuple[dict[str, torch.Tensor], dict[Shard, torch.Tensor]]:
    specs = layout.tensor_map()
    tensors = {
        t: torch.full(shape, float("nan")).to(getattr(torch, specs[t].dtype))
        for t, shape in layout.local_shapes_on(rank).items()
    }
    views = {}
    for placement in layout.placements_on(rank):
        view = placement.view(tensors[placement.shard.tensor])
        if fill is not None:
            view.copy_(fill[placement.shard.tensor][placement.shard.region.slices() or ...])
        views[placement.shard] = view
    return tensors, views


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def _store(rank: int, world: int, port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))


def reshard_worker(rank: int, world: int, port: int) -> list[dict[str, Any]]:
    store = _store(rank, world, port)
    out = []
    for index, (src_spec, dst_spec, chunk, direct) in enumerate(CASES):
        src, dst = trainer_layout(model(), src_spec), trainer_layout(model(), dst_spec)
        plan = plan_reshard(dst.tensor_map(), src.shards, dst.shards)
        full = {t.name: global_tensor(t, seed=i) for i, t in enumerate(dst.tensors)}
        _, sources = locals_for(src, rank, full)
        before = {s: v.clone() for s, v in sources.items()}
        _, destinations = locals_for(dst, rank, None)
        group = None
        if rank in plan.ranks:
            group = build_group(store, name=f"test/{index}", ranks=plan.ranks, rank=rank)
        report = execute_plan(
            plan,
            rank=rank,
            group=group,
            sources=sources,
            destinations=destinations,
            config=ExecutorConfig(chunk_bytes=chunk, direct_bytes=direct, timeout_s=30),
        )
        for shard, view in destinations.items():
            assert same_bits(view, full[shard.tensor][shard.region.slices() or ...]), shard
        assert all(same_bits(v, before[s]) for s, v in sources.items())
        if group is not None:
            group.close()
        out.append(
            {
                "verified": report.verified,
                "rounds": report.num_rounds,
                "sent": report.bytes_sent,
                "moved": plan.bytes_moved,
            }
        )
    return out


def test_plans_execute_bitwise_over_gloo(spawn_ranks: Any) -> None:
    results = spawn_ranks(reshard_worker, WORLD)
    for index in range(len(CASES)):
        per_rank = [r[index] for r in results]
        assert all(r["verified"] for r in per_rank)
        assert sum(r["sent"] for r in per_rank) == per_rank[0]["moved"]
    assert max(r[2]["rounds"] for r in results) > 1, "small chunks must take several rounds"


def aliasing_worker(rank: int, world: int, port: int) -> tuple[bool, list[str]]:
    """Two destination shards share memory: the first written one is overwritten."""
    store = _store(rank, world, port)
    t = TensorSpec(name="t", shape=(4, 4), dtype="float32")
    halves = [Region(offsets=(2 * i, 0), sizes=(2, 4)) for i in range(2)]
    src = [Shard(tensor="t", rank=0, region=t.full())]
    dst = [Shard(tensor="t", rank=1, region=h) for h in halves]
    plan = plan_reshard({"t": t}, src, dst)
    full = torch.arange(16.0).reshape(4, 4)
    shared = torch.zeros(2, 4)
    sources = {src[0]: full} if rank == 0 else {}
    destinations = {s: shared for s in dst} if rank == 1 else {}
    group = build_group(store, name="test/alias", ranks=(0, 1), rank=rank) if rank < 2 else None
    report = execute_plan(plan, rank=rank, group=group, sources=sources, destinations=destinations)
    if group is not None:
        group.close()
    return report.verified, [str(s.region) for s in report.mismatched]


def test_checksums_catch_a_corrupted_destination(spawn_ranks: Any) -> None:
    results = spawn_ranks(aliasing_worker, 2)
    assert results[0] == (True, [])
    assert results[1] == (False, ["[0:2, 0:4]"])


def padded_worker(rank: int, world: int, port: int) -> tuple[bool, bool]:
    """Views that the plan's geometry calls contiguous but that are not (rows of a padded
    tensor) are staged; contiguous ones go in place, even when cut mid-row."""
    store = _store(rank, world, port)
    t = TensorSpec(name="t", shape=(8, 16), dtype="float32")
    halves = [Region(offsets=(4 * i, 0), sizes=(4, 16)) for i in range(2)]
    src = [Shard(tensor="t", rank=0, region=t.full())]
    dst = [Shard(tensor="t", rank=1, region=h) for h in halves]
    plan = plan_reshard({"t": t}, src, dst)
    full = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    padded = torch.full((8, 19), -1.0)
    padded[:, :16] = full
    sources = {src[0]: padded[:, :16]} if rank == 0 else {}
    out_padded = torch.full((4, 19), -1.0)
    out_plain = torch.zeros(4, 16)
    destinations = {dst[0]: out_padded[:, :16], dst[1]: out_plain} if rank == 1 else {}
    group = build_group(store, name="test/padded", ranks=(0, 1), rank=rank)
    config = ExecutorConfig(chunk_bytes=40, direct_bytes=1, timeout_s=30)
    report = execute_plan(
        plan, rank=rank, group=group, sources=sources, destinations=destinations, config=config
    )
    group.close()
    if rank == 0:
        return report.verified, bool((padded[:, 16:] == -1).all())
    exact = same_bits(out_padded[:, :16], full[:4]) and same_bits(out_plain, full[4:])
    return report.verified and exact, bool((out_padded[:, 16:] == -1).all())


def test_strided_views_are_staged_and_contiguous_ones_cut_mid_row(spawn_ranks: Any) -> None:
    assert spawn_ranks(padded_worker, 2) == [(True, True), (True, True)]


def timeout_worker(rank: int, world: int, port: int) -> list[str]:
    """Rank 1 joins the group but never sends: rank 0's warm-up in prepare times out, and
    without a warm-up (prepare then does not communicate) its wait in run times out."""
    store = _store(rank, world, port)
    t = TensorSpec(name="t", shape=(8,), dtype="float32")
    src = [Shard(tensor="t", rank=1, region=t.full())]
    dst = [Shard(tensor="t", rank=0, region=t.full())]
    plan = plan_reshard({"t": t}, src, dst)
    group: CommGroup = build_group(store, name="test/timeout", ranks=(0, 1), rank=rank)
    outcomes = []
    if rank == 0:
        for warmup in (1 << 20, 0):
            config = ExecutorConfig(timeout_s=1.0, warmup_bytes=warmup)
            executor = PlanExecutor(plan, rank=0, group=group, config=config)
            try:
                executor.prepare({dst[0]: torch.zeros(8)})
                outcomes.append("prepared")
                executor.run({})
                outcomes.append("completed")
            except MigrationError as exc:
                outcomes.append(f"MigrationError: {exc}")
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{1 - rank}"], timedelta(seconds=30))
    return outcomes


def test_a_silent_peer_times_out(spawn_ranks: Any) -> None:
    warm, prepared, cold = spawn_ranks(timeout_worker, 2)[0]
    assert warm.startswith("MigrationError: reshard warm-up"), warm
    assert prepared == "prepared"
    assert cold.startswith("MigrationError: reshard round 0"), cold


def test_checksum_is_position_sensitive() -> None:
    data = torch.arange(64, dtype=torch.uint8)
    swapped = data.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert checksum(data) != checksum(swapped)
    assert checksum(data) == checksum(data.clone())
