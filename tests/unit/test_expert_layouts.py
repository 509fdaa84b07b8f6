"""Expert, context, sequence and virtual-pipeline layouts, and the plans between them.

Small MoE models: where each expert, its optimizer state and each layer chunk land, what a
change of each dimension moves (the minimum, computed here from element masks), and the
combinations that stay refused.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from dynarl.migrate import (
    Layout,
    LayoutGroups,
    LayoutSpec,
    ParamSpec,
    ReshardPlan,
    Stage,
    plan_reshard,
    trainer_layout,
)
from dynarl.migrate._trainer_placement import pipeline_chunks

H, FFN, VOCAB = 8, 16, 16


def moe(layers: int = 2, experts: int = 4) -> list[ParamSpec]:
    params = [ParamSpec(name="embedding", shape=(VOCAB, H), tp_dim=0, stage=Stage.FIRST)]
    for n in range(layers):
        params += [
            ParamSpec(name=f"layers.{n}.qkv.weight", shape=(3 * H, H), tp_dim=0, layer=n),
            ParamSpec(name=f"layers.{n}.proj.weight", shape=(H, H), tp_dim=1, layer=n),
            ParamSpec(name=f"layers.{n}.router.weight", shape=(experts, H), layer=n),
        ]
        for e in range(experts):
            head = f"layers.{n}.experts.local_experts.{e}"
            params += [
                ParamSpec(
                    name=f"{head}.fc1.weight",
                    shape=(2 * FFN, H),
                    tp_dim=0,
                    tp_stride=2,
                    layer=n,
                    expert=e,
                ),
                ParamSpec(name=f"{head}.fc2.weight", shape=(H, FFN), tp_dim=1, layer=n, expert=e),
            ]
    params += [
        ParamSpec(name="final_norm", shape=(H,), stage=Stage.LAST),
        ParamSpec(name="output", shape=(VOCAB, H), tp_dim=0, stage=Stage.LAST),
    ]
    return params


def minimum_bytes(src: Layout, dst: Layout) -> int:
    """Bytes of destination elements their rank does not hold already (element masks)."""
    specs = src.tensor_map()
    held: dict[tuple[str, int], np.ndarray] = {}
    for shard in src.shards:
        mask = held.setdefault(
            (shard.tensor, shard.rank), np.zeros(specs[shard.tensor].shape, bool)
        )
        mask[shard.region.slices() or ...] = True
    total = 0
    for shard in dst.shards:
        mask = held.get((shard.tensor, shard.rank))
        need = np.ones(shard.region.sizes, bool)
        if mask is not None:
            need &= ~mask[shard.region.slices() or ...]
        total += int(need.sum()) * specs[shard.tensor].itemsize
    return total


def plan(params: list[ParamSpec], a: LayoutSpec, b: LayoutSpec) -> tuple[ReshardPlan, int]:
    src, dst = trainer_layout(params, a), trainer_layout(params, b)
    return plan_reshard(dst.tensor_map(), src.shards, dst.shards), minimum_bytes(src, dst)


def holders(layout: Layout, tensor: str) -> dict[int, int]:
    """``{rank: elements of tensor held}``."""
    out: dict[int, int] = defaultdict(int)
    for shard in layout.shards:
        if shard.tensor == tensor:
            out[shard.rank] += shard.region.numel
    return dict(out)


def test_sequence_parallel_is_a_flag_that_moves_no_bytes() -> None:
    for distopt in (False, True):
        off = LayoutSpec(ranks=(0, 1, 2, 3), tp=2, dp=2, distributed_optimizer=distopt)
        on = LayoutSpec(
            ranks=(0, 1, 2, 3), tp=2, dp=2, sequence_parallel=True, distributed_optimizer=distopt
        )
        for a, b in ((off, on), (on, off)):
            result, minimum = plan(moe(), a, b)
            assert result.bytes_moved == 0 and minimum == 0
            assert all(item.is_local for item in result.items)
    assert trainer_layout(moe(), on).name.endswith("-sp-distopt")


def test_each_expert_lives_on_one_expert_parallel_rank() -> None:
    layout = trainer_layout(moe(), LayoutSpec(ranks=(0, 1), dp=2, expert_parallel=2))
    for e in range(4):
        fc1 = f"layers.0.experts.local_experts.{e}.fc1.weight"
        assert holders(layout, fc1) == {e // 2: 2 * FFN * H}
        assert holders(layout, f"{fc1}/exp_avg") == {e // 2: 2 * FFN * H}
    assert holders(layout, "layers.1.router.weight") == {0: 4 * H, 1: 4 * H}


def test_expert_tensor_parallel_uses_the_expert_rank_generator() -> None:
    # tp2 dp2 on four ranks; experts over ep2 x etp1 x edp2: ep_rank = index % 2.
    spec = LayoutSpec(ranks=(0, 1, 2, 3), tp=2, dp=2, expert_parallel=2, expert_tensor_parallel=1)
    assert spec.group_ranks("ep") == [(0, 1), (2, 3)]
    assert spec.group_ranks("edp") == [(0, 2), (1, 3)]
    assert spec.group_ranks("etp") == [(0,), (1,), (2,), (3,)]
    assert spec.group_ranks("tp") == [(0, 1), (2, 3)] and spec.edp == 2
    layout = trainer_layout(moe(), spec)
    assert holders(layout, "layers.0.experts.local_experts.0.fc2.weight") == {
        0: H * FFN,
        2: H * FFN,
    }
    assert holders(layout, "layers.0.experts.local_experts.3.fc2.weight") == {
        1: H * FFN,
        3: H * FFN,
    }
    assert holders(layout, "layers.0.qkv.weight") == {r: 3 * H * H // 2 for r in range(4)}


def test_expert_optimizer_state_is_sharded_over_expert_data_parallel_ranks() -> None:
    spec = LayoutSpec(
        ranks=(0, 1, 2, 3),
        tp=2,
        dp=2,
        expert_parallel=2,
        expert_tensor_parallel=1,
        distributed_optimizer=True,
    )
    layout = trainer_layout(moe(), spec)
    for e in range(4):
        state = f"layers.1.experts.local_experts.{e}.fc1.weight/exp_avg"
        held = holders(layout, state)
        assert set(held) <= ({0, 2} if e < 2 else {1, 3})
        assert sum(held.values()) == 2 * FFN * H  # each element once over expert DP


def test_expert_parallel_change_moves_the_minimum() -> None:
    ep2 = LayoutSpec(ranks=(0, 1), dp=2, expert_parallel=2, distributed_optimizer=True)
    tp2 = LayoutSpec(ranks=(0, 1), tp=2, sequence_parallel=True, distributed_optimizer=True)
    for a, b in ((ep2, tp2), (tp2, ep2)):
        result, minimum = plan(moe(), a, b)
        assert result.bytes_moved == minimum > 0


def test_context_parallel_replicates_parameters_and_moves_optimizer_state() -> None:
    cp2 = LayoutSpec(ranks=(0, 1), context_parallel=2, distributed_optimizer=True)
    layout = trainer_layout(moe(), cp2)
    assert holders(layout, "output") == {0: VOCAB * H, 1: VOCAB * H}
    assert sum(holders(layout, "output/exp_avg").values()) == VOCAB * H  # sharded over dp x cp
    assert cp2.group_ranks("dp_cp") == [(0, 1)] and layout.name == "tp1-pp1-dp1-cp2-distopt"
    # Same ranks, dp x cp unchanged: Megatron shards the same way, nothing moves.
    result, minimum = plan(moe(), cp2, LayoutSpec(ranks=(0, 1), dp=2, distributed_optimizer=True))
    assert result.bytes_moved == minimum == 0
    # CP 1 -> 2 on twice the ranks: the optimizer shards are cut anew.
    dp2 = LayoutSpec(ranks=(0, 1), dp=2, distributed_optimizer=True)
    wide = LayoutSpec(ranks=(0, 1, 2, 3), dp=2, context_parallel=2, distributed_optimizer=True)
    result, minimum = plan(moe(), dp2, wide)
    assert result.bytes_moved == minimum
    moved = [i for i in result.items if not i.is_local and i.tensor.endswith("/exp_avg")]
    assert any(i.dst_rank == 1 for i in moved)  # rank 1 held the second half, needs a quarter
    without = [dict(context_parallel=2), dict(dp=2)]
    result, minimum = plan(moe(), *(LayoutSpec(ranks=(0, 1), **kw) for kw in without))  # type: ignore[arg-type]
    assert result.bytes_moved == minimum == 0


def test_virtual_pipeline_interleaves_layers_as_megatron_does() -> None:
    params = moe(layers=8, experts=2)
    spec = LayoutSpec(ranks=(0, 1), pp=2, virtual_pipeline=2)
    chunks = pipeline_chunks(params, spec)
    # Megatron's example: stage 0 builds [0, 1] [4, 5], stage 1 [2, 3] [6, 7].
    got = [chunks[f"layers.{n}.qkv.weight"] for n in range(8)]
    assert got == [(0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)]
    assert chunks["embedding"] == (0, 0) and chunks["output"] == (1, 1)
    four = pipeline_chunks(params, LayoutSpec(ranks=(0, 1), pp=2, virtual_pipeline=4))
    assert [four[f"layers.{n}.qkv.weight"][0] for n in range(8)] == [0, 1] * 4
    flat = LayoutSpec(ranks=(0, 1), pp=2, distributed_optimizer=True, bucket_size=64)
    inter = LayoutSpec(
        ranks=(0, 1), pp=2, virtual_pipeline=2, distributed_optimizer=True, bucket_size=64
    )
    result, minimum = plan(params, flat, inter)
    assert result.bytes_moved == minimum > 0
    remote = {i.tensor.split(".")[1] for i in result.items if not i.is_local}
    assert remote == {"2", "3", "4", "5"}  # the layers that change stage, nothing else


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ranks": (0, 1), "tp": 2, "expert_tensor_parallel": 1}, "expert_tensor_parallel"),
        ({"ranks": (0, 1), "tp": 2, "expert_parallel": 2}, "expert_parallel: world size 2"),
        ({"ranks": (0, 1), "dp": 2, "sequence_parallel": True}, "sequence_parallel needs tp"),
        ({"ranks": (0, 1), "dp": 2, "virtual_pipeline": 2}, "virtual_pipeline > 1 needs pp"),
        ({"ranks": (0, 1), "dp": 2, "context_parallel": 0}, "context_parallel must be"),
        ({"ranks": (0, 1, 2), "dp": 2, "context_parallel": 2}, "tp\\*cp\\*dp\\*pp = 4"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(
    kwargs: dict[str, object], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        LayoutSpec(**kwargs)  # type: ignore[arg-type]


def test_models_that_do_not_fit_the_layout_are_refused() -> None:
    dense = [p for p in moe() if p.expert is None]
    with pytest.raises(ValueError, match="expert_parallel: ep=2 but the model has no expert"):
        trainer_layout(dense, LayoutSpec(ranks=(0, 1), dp=2, expert_parallel=2))
    six = LayoutSpec(ranks=tuple(range(4)), dp=4, expert_parallel=4)
    with pytest.raises(ValueError, match="expert_parallel: 6 experts do not split evenly"):
        trainer_layout(moe(experts=6), six)
    with pytest.raises(ValueError, match=r"pipeline: 2 layers .* 2 stages x 2 virtual stages"):
        trainer_layout(moe(), LayoutSpec(ranks=(0, 1), pp=2, virtual_pipeline=2))
    with pytest.raises(ValueError, match="expert must be >= 0 and belong to a layer"):
        ParamSpec(name="e", shape=(2,), stage=Stage.LAST, expert=0)


def test_groups_of_a_rank_follow_the_new_dimensions() -> None:
    plain = LayoutGroups.member_ranks(LayoutSpec(ranks=(0, 1), tp=2), 1)
    assert set(plain) == {"tp", "dp", "pp", "mp", "cp", "embd", "pos_embd"}
    assert plain["cp"] == (1,)
    spec = LayoutSpec(
        ranks=(0, 1, 2, 3), tp=2, context_parallel=2, expert_parallel=2, expert_tensor_parallel=1
    )
    mine = LayoutGroups.member_ranks(spec, 1)
    assert mine["cp"] == (1, 3) and mine["dp_cp"] == (1, 3) and mine["tp_cp"] == (0, 1, 2, 3)
    assert mine["ep"] == (0, 1) and mine["edp"] == (1, 3) and mine["etp"] == (1,)
    assert mine["tp_ep"] == (0, 1)
    assert spec.coord(3, "cp") == 1 and spec.coord(3, "edp") == 1 and spec.coords(3) == (1, 0, 0)
    with pytest.raises(ValueError, match="unknown dimension 'xp'"):
        spec.coord(0, "xp")
