"""Planner and layout inputs: bad input is refused by name; planning needs no torch."""

from __future__ import annotations

import ast
import pathlib
import time

import pytest

import dynarl.migrate
from dynarl.migrate import (
    LayoutSpec,
    ParamSpec,
    Region,
    Shard,
    Stage,
    TensorSpec,
    plan_reshard,
    replicated_layout,
    trainer_layout,
)
from dynarl.migrate._protocol import Step, begin, new_migration
from dynarl.types import MigrationKind

T = TensorSpec(name="w", shape=(4, 6), dtype="float32")
FULL = T.full()


def shard(rank: int, offsets: tuple[int, ...], sizes: tuple[int, ...], name: str = "w") -> Shard:
    return Shard(tensor=name, rank=rank, region=Region(offsets=offsets, sizes=sizes))


@pytest.mark.parametrize(
    ("src", "dst", "words"),
    [
        (
            [shard(0, (0, 0), (4, 6))],
            [shard(1, (0, 0), (4, 6), "v")],
            ["unknown tensor", "'v'", "[0:4, 0:6]"],
        ),
        ([shard(0, (0, 0), (4, 6))], [shard(1, (2, 0), (3, 6))], ["outside", "'w'", "[2:5, 0:6]"]),
        (
            [shard(0, (0, 0), (4, 6))],
            [shard(1, (0, 0), (2, 6)), shard(1, (1, 0), (2, 6))],
            ["overlap", "'w'", "[0:2, 0:6]", "[1:3, 0:6]"],
        ),
        (
            [shard(0, (0, 0), (2, 6))],
            [shard(1, (0, 0), (4, 6))],
            ["not held", "'w'", "[0:4, 0:6]", "[2:4, 0:6]"],
        ),
        (
            [shard(0, (0, 0), (3, 6)), shard(0, (2, 0), (2, 6))],
            [shard(1, (0, 0), (4, 6))],
            ["source", "overlap", "'w'"],
        ),
    ],
)
def test_bad_input_names_tensor_and_region(
    src: list[Shard], dst: list[Shard], words: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        plan_reshard({"w": T}, src, dst)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_replicas_on_other_ranks_may_overlap_and_local_data_never_moves() -> None:
    src = [shard(r, (0, 0), (4, 6)) for r in (0, 1)]
    dst = [shard(r, (0, 0), (4, 6)) for r in (1, 2, 3)]
    plan = plan_reshard({"w": T}, src, dst)
    assert plan.bytes_moved == 2 * T.nbytes and plan.local_bytes == T.nbytes
    assert plan.max_rank_send_bytes == T.nbytes  # ranks 0 and 1 share the two sends


@pytest.mark.parametrize(
    ("field", "value", "suffix"),
    [
        ("context_parallel", 2, "-cp2"),
        ("expert_parallel", 2, "-ep2"),
        ("sequence_parallel", True, "-sp"),
        ("virtual_pipeline", 2, "-vpp2"),
    ],
)
def test_context_expert_sequence_and_virtual_pipeline_layouts_are_built(
    field: str, value: object, suffix: str
) -> None:
    # Refusals of the combinations that stay unsupported: tests/unit/test_expert_layouts.py.
    params = [
        ParamSpec(name=f"l{n}.e{e}", shape=(4, 2), tp_dim=0, layer=n, expert=e)
        for n in range(4)
        for e in range(2)
    ]
    dp = 1 if field == "context_parallel" else 2
    spec = LayoutSpec(ranks=tuple(range(8)), tp=2, pp=2, dp=dp, **{field: value})  # type: ignore[arg-type]
    assert trainer_layout(params, spec).name.endswith(suffix)


def test_layout_spec_checks_sizes_and_ranks() -> None:
    with pytest.raises(ValueError, match="ranks given"):
        LayoutSpec(ranks=(0, 1, 2), tp=2)
    with pytest.raises(ValueError, match="distinct"):
        LayoutSpec(ranks=(0, 0), tp=2)
    spec = LayoutSpec(ranks=(5, 6, 7, 8, 9, 10, 11, 12), tp=2, dp=2, pp=2)
    assert spec.coords(spec.rank(tp_rank=1, dp_rank=0, pp_rank=1)) == (1, 0, 1)
    assert spec.group_ranks("tp")[0] == (5, 6) and spec.group_ranks("dp")[0] == (5, 7)
    assert spec.group_ranks("pp")[0] == (5, 9) and spec.group_ranks("mp")[0] == (5, 6, 9, 10)


def test_uneven_tp_split_and_pipeline_are_refused() -> None:
    odd = [ParamSpec(name="w", shape=(6, 4), tp_dim=0, layer=0)]
    with pytest.raises(ValueError, match=r"tensor parallel.*'w'"):
        trainer_layout(odd, LayoutSpec(ranks=(0, 1, 2, 3), tp=4))
    three = [ParamSpec(name=f"l{i}", shape=(2,), layer=i) for i in range(3)]
    with pytest.raises(ValueError, match="pipeline"):
        trainer_layout(three, LayoutSpec(ranks=(0, 1), pp=2))
    tied = [
        ParamSpec(name="emb", shape=(4, 2), stage=Stage.FIRST, shared_embedding=True),
        *three[:2],
    ]
    with pytest.raises(ValueError, match="pipeline"):
        trainer_layout(tied, LayoutSpec(ranks=(0, 1), pp=2))


def test_weight_sync_to_replicated_engines_moves_each_parameter_once_per_engine() -> None:
    params = [
        ParamSpec(name="a", shape=(8, 4), tp_dim=0, layer=0),
        ParamSpec(name="b", shape=(4, 8), tp_dim=1, layer=0),
        ParamSpec(name="n", shape=(4,), layer=0),
    ]
    trainer = trainer_layout(params, LayoutSpec(ranks=(0, 1, 2, 3), tp=2, dp=2))
    engines = replicated_layout(params, ranks=(4, 5))
    plan = plan_reshard(trainer.tensor_map(), trainer.shards, engines.shards)
    assert plan.local_bytes == 0
    assert plan.bytes_moved == 2 * sum(4 * 32 for _ in params[:2]) + 2 * 4 * 4
    assert plan.max_rank_send_bytes < plan.bytes_moved / 2  # spread over the DP replicas


PLANNING = ["_region", "_reshard_plan", "_layout", "_trainer_placement", "_buffer", "_protocol"]


@pytest.mark.parametrize("module", PLANNING)
def test_planning_modules_import_no_torch(module: str) -> None:
    path = pathlib.Path(dynarl.migrate.__file__).parent / f"{module}.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert not {m for m in imported if m.split(".")[0] in ("torch", "megatron")}


def test_lease_expiry_refuses_forward_steps() -> None:
    state = new_migration("m", MigrationKind.P2P, now=time.monotonic(), lease_s=1.0)
    start = begin(state, Step.PREPARE, now=state.deadline + 0.1)
    assert not start.run and start.outcome is not None and start.outcome.detail == "lease expired"
