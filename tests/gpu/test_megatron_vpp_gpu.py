"""The interleaved pipeline (PP 2 × VPP 2) trained on CUDA (marker ``gpu``) against PP 1,
and its chunks against dynarl's layout (see ``cp_vpp_support.py`` for the design notes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cp_vpp_support import (
    BACKEND,
    STEPS,
    TIMEOUT,
    TRAIN,
    TWO_GPUS,
    VPP_LOSS_RTOL,
    VPP_MODEL,
    VPP_PARAM_RTOL,
    activate,
    build_chunk,
    chunk_optimizer,
    forward_backward,
    gather,
    initial,
    relative_l2,
    samples,
    start_rank,
)
from migrate_ranks import run_ranks

from dynarl.backends.megatron import MegatronTrainer
from dynarl.backends.megatron._gpt_model import (
    describe,
    wrap_ddp,
)
from dynarl.migrate import (
    Layout,
    LayoutGroups,
    LayoutSpec,
    ParamSpec,
    build_group,
    param_names,
    sharded_state_dict_mismatches,
    trainer_layout,
)
from dynarl.migrate._trainer_placement import pipeline_chunks

pytestmark = [
    pytest.mark.gpu,
    # Megatron 0.16.1's RowParallelLinear warns on rank 0 that it passes no group.
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]


def vpp_spec(ranks: tuple[int, ...]) -> LayoutSpec:
    """PP len(ranks) × VPP 2, or one rank without a pipeline (fp32, plain optimizer)."""
    if len(ranks) == 1:
        return LayoutSpec(ranks=ranks)
    return LayoutSpec(ranks=ranks, pp=len(ranks), virtual_pipeline=2)


def chunk_problems(
    chunks: Sequence[torch.nn.Module],
    layout: Layout,
    specs: Sequence[ParamSpec],
    groups: LayoutGroups,
    rank: int,
) -> list[str]:
    """Where this rank's chunks disagree with dynarl: the parameters of chunk ``v`` are
    exactly those ``pipeline_chunks`` gives (pipeline rank, v), and every shard matches
    the chunk's ``sharded_state_dict()``."""
    assert layout.spec is not None
    where = pipeline_chunks(specs, layout.spec)
    pp_rank = layout.spec.coord(rank, "pp")
    metadata = {"dp_cp_group": groups.groups["dp"].pg}
    problems = []
    for vp, chunk in enumerate(chunks):
        have = sorted(name for _, name, _ in param_names(chunk))
        want = sorted(n for n, c in where.items() if c == (pp_rank, vp))
        if have != want:
            problems.append(f"chunk ({pp_rank}, {vp}): megatron {have} != dynarl {want}")
        problems += sharded_state_dict_mismatches(chunk, layout, rank, metadata=metadata)
    return problems


def vpp_train(store: Any, rank: int, spec: LayoutSpec, epoch: int) -> dict[str, Any]:
    """Build this rank's chunks of VPP_MODEL under ``spec`` from the initial weights, check
    them, train STEPS steps with Megatron's schedule; the losses (None before the last
    stage), the layout problems, and the trained parameters of the whole model, gathered
    through the layout on its first rank (``{}`` elsewhere)."""
    specs = describe(VPP_MODEL)
    layout = trainer_layout(specs, spec)
    groups = LayoutGroups.build(
        store, spec, rank=rank, epoch=epoch, backend=BACKEND, timeout=TIMEOUT
    )
    stages = [None] if spec.vpp == 1 else list(range(spec.vpp))
    chunks = [
        build_chunk(VPP_MODEL, spec, groups, rank=rank, vp_stage=vp, init=True, specs=specs)
        for vp in stages
    ]
    activate(groups)
    out: dict[str, Any] = {"layout": chunk_problems(chunks, layout, specs, groups, rank)}
    ddps = [wrap_ddp(chunk, spec, groups) for chunk in chunks]
    optimizer = chunk_optimizer(ddps, groups)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses.append(forward_backward(spec, groups, ddps, samples(0), explicit_mask=True))
        ok, _, _ = optimizer.step()
        assert ok, "Megatron skipped the step"
    out["losses"] = losses
    whole = build_group(
        store, name=f"vpp/{epoch}/gather", ranks=spec.ranks, rank=rank, backend=BACKEND,
        timeout=TIMEOUT,
    )  # fmt: skip
    local = {name: param.data for chunk in chunks for _, name, param in param_names(chunk)}
    params = gather(
        layout, local, rank=rank, root=spec.ranks[0], group=whole, names=initial(VPP_MODEL)
    )
    out["params"] = {n: t.cpu() for n, t in params.items()}
    whole.close()
    groups.close()
    return out


def vpp_worker(rank: int, world: int, port: int) -> dict[str, Any]:
    """PP 2 × VPP 2 on ranks (0, 1), then the PP 1 reference on rank 0."""
    store = start_rank(rank, world, port)
    out = vpp_train(store, rank, vpp_spec((0, 1)), epoch=0)
    if rank == 0:
        reference = vpp_train(store, 0, vpp_spec((0,)), epoch=1)
        start = {n: t.cpu() for n, t in initial(VPP_MODEL).items()}
        moved = {n: out["params"][n] - start[n] for n in start}
        expected = {n: reference["params"][n] - start[n] for n in start}
        out |= {
            "reference_losses": reference["losses"],
            "reference_layout": reference["layout"],
            "param_error": relative_l2(moved, expected),
        }
    del out["params"]
    dist.destroy_process_group()
    return out


@TWO_GPUS
@pytest.mark.timeout(480)
def test_interleaved_pipeline_trains_like_pp1_and_matches_its_layout() -> None:
    rank0, rank1 = run_ranks(vpp_worker, 2, timeout_s=420)
    assert rank0["layout"] == [] and rank1["layout"] == [], (rank0["layout"], rank1["layout"])
    assert rank0["reference_layout"] == []
    assert rank0["losses"] == [None] * STEPS  # the losses live on the last stage
    torch.testing.assert_close(
        torch.tensor(rank1["losses"]),
        torch.tensor(rank0["reference_losses"]),
        rtol=VPP_LOSS_RTOL,
        atol=0,
    )
    assert rank0["param_error"] <= VPP_PARAM_RTOL, rank0["param_error"]
    assert rank1["losses"][-1] < rank1["losses"][0]


def vpp_solo_worker(rank: int, world: int, port: int) -> dict[str, Any]:
    """One GPU: MegatronTrainer's SFT steps and the PP 1 run through Megatron's schedule."""
    store = start_rank(rank, world, port)
    trainer = MegatronTrainer(VPP_MODEL, TRAIN, rank=0, store=store)
    trainer.start(trainer.layout_spec((0,)), epoch=0)
    expected = [trainer.sft_step(samples(0)).loss for _ in range(STEPS)]
    trainer.close()
    out = vpp_train(store, 0, vpp_spec((0,)), epoch=1)
    dist.destroy_process_group()
    return {"expected": expected, "losses": out["losses"], "layout": out["layout"]}


def test_megatron_schedule_reproduces_the_trainer_on_one_gpu() -> None:
    (result,) = run_ranks(vpp_solo_worker, 1)
    assert result["layout"] == [], result["layout"]
    torch.testing.assert_close(
        torch.tensor(result["losses"]),
        torch.tensor(result["expected"]),
        rtol=VPP_LOSS_RTOL,
        atol=0,
    )
    assert result["losses"][-1] < result["losses"][0]
