"""The reshard executor on CUDA: device-side checksums, and the same plan over NCCL.

Skipped without CUDA (the NCCL test needs two devices: NCCL refuses two ranks on one).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from migrate_ranks import run_ranks

from dynarl.migrate import LayoutSpec, ParamSpec, Stage, plan_reshard, trainer_layout
from dynarl.migrate._executor import ExecutorConfig, checksum, execute_plan
from dynarl.migrate._groups import build_group

pytestmark = pytest.mark.gpu


def test_cuda_checksum_is_position_sensitive_and_matches_itself() -> None:
    data = torch.arange(4099, dtype=torch.int64).to(torch.uint8).cuda()
    swapped = data.clone()
    swapped[[3, 4000]] = swapped[[4000, 3]]
    assert checksum(data) == checksum(data.clone()) != checksum(swapped)


def model() -> list[ParamSpec]:
    return [
        ParamSpec(name="emb", shape=(64, 32), tp_dim=0, stage=Stage.FIRST),
        ParamSpec(name="w", shape=(32, 64), tp_dim=1, layer=0),
        ParamSpec(name="n", shape=(32,), layer=0),
    ]


def nccl_worker(rank: int, world: int, port: int) -> bool:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    src = trainer_layout(model(), LayoutSpec(ranks=(0, 1), tp=2))
    dst = trainer_layout(model(), LayoutSpec(ranks=(1, 0), dp=2, distributed_optimizer=True))
    plan = plan_reshard(dst.tensor_map(), src.shards, dst.shards)
    full = {
        t.name: torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).cuda()
        for i, t in enumerate(dst.tensors)
    }
    local = {t: torch.empty(s, device="cuda") for t, s in src.local_shapes_on(rank).items()}
    sources = {}
    for p in src.placements_on(rank):
        view = p.view(local[p.shard.tensor])
        view.copy_(full[p.shard.tensor][p.shard.region.slices() or ...])
        sources[p.shard] = view
    out = {t: torch.zeros(s, device="cuda") for t, s in dst.local_shapes_on(rank).items()}
    destinations = {p.shard: p.view(out[p.shard.tensor]) for p in dst.placements_on(rank)}
    group = build_group(store, name="nccl-test", ranks=(0, 1), rank=rank, backend="nccl")
    report = execute_plan(
        plan,
        rank=rank,
        group=group,
        sources=sources,
        destinations=destinations,
        config=ExecutorConfig(chunk_bytes=4096, direct_bytes=1024),
    )
    ok = report.verified and all(
        torch.equal(v, full[s.tensor][s.region.slices() or ...]) for s, v in destinations.items()
    )
    group.close()
    return ok


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two devices")
def test_plan_executes_over_nccl_with_the_gloo_code_path() -> None:
    results: list[Any] = run_ranks(nccl_worker, 2)
    assert results == [True, True]
