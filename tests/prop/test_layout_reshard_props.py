"""Layouts match Megatron's way of splitting, and a planned reshard rebuilds them exactly.

Random GPT-shaped models (strided GLU fc1 included, MoE layers with 2 or 4 experts and a
router included) under random (tp, cp, pp, virtual pipeline, dp, ep, expert tp, sequence
parallel, distributed optimizer, master copy, bucket size, ranks) layouts. Each rank's
local arrays are built the way Megatron builds them (``torch.split`` into ``tp * stride``
chunks, ``[tp_rank::tp]``; ranks decomposed as ``tp-cp-dp-pp`` and, for experts,
``etp-ep-edp-pp``; layers per model chunk from ``get_transformer_layer_offset``; flat
ranges of the chunk's dense buffer over dp × cp and of its expert buffer over the expert
data-parallel ranks), independently of the placement code; every placement must view
exactly the global elements it claims. Then a plan from one layout to another is applied
with numpy to garbage-filled destination arrays: every destination element must be written
exactly once, the arrays must come out equal to the destination layout's Megatron-built
arrays, and the bytes moved must equal the minimum computed from element masks.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dynarl.migrate import (
    BufferParam,
    Layout,
    LayoutSpec,
    ParamSpec,
    Stage,
    dp_buffer,
    dp_param_ranges,
    plan_reshard,
    trainer_layout,
)
from dynarl.migrate._trainer_placement import local_shape

WORLD = 8


@st.composite
def models(draw: st.DrawFn) -> list[ParamSpec]:
    h = draw(st.sampled_from([4, 8]))
    f = 2 * h
    vocab = draw(st.sampled_from([8, 16]))
    layers = draw(st.sampled_from([1, 2, 4]))
    glu = draw(st.booleans())
    experts = draw(st.sampled_from([0, 0, 2, 4]))
    params = [ParamSpec(name="emb", shape=(vocab, h), tp_dim=0, stage=Stage.FIRST)]
    for n in range(layers):

        def p(
            name: str,
            shape: tuple[int, ...],
            dim: int | None,
            stride: int = 1,
            n: int = n,
            expert: int | None = None,
        ) -> ParamSpec:
            return ParamSpec(
                name=f"l{n}.{name}",
                shape=shape,
                tp_dim=dim,
                tp_stride=stride,
                layer=n,
                expert=expert,
            )

        params += [
            p("norm", (h,), None),
            p("qkv.w", (3 * h, h), 0),
            p("qkv.b", (3 * h,), 0),
            p("proj.w", (h, h), 1),
            p("proj.b", (h,), None),
        ]
        if not experts:
            params += [
                p("fc1.w", (2 * f if glu else f, h), 0, 2 if glu else 1),
                p("fc2.w", (h, f), 1),
            ]
            continue
        params.append(p("router.w", (experts, h), None))
        for e in range(experts):
            params += [
                p(f"experts.{e}.fc1.w", (2 * f if glu else f, h), 0, 2 if glu else 1, expert=e),
                p(f"experts.{e}.fc2.w", (h, f), 1, expert=e),
            ]
    params += [
        ParamSpec(name="final_norm", shape=(h,), stage=Stage.LAST),
        ParamSpec(name="out", shape=(vocab, h), tp_dim=0, stage=Stage.LAST),
    ]
    return params


def num_experts(params: list[ParamSpec]) -> int:
    return 1 + max((p.expert for p in params if p.expert is not None), default=-1)


@st.composite
def layout_specs(draw: st.DrawFn, params: list[ParamSpec]) -> LayoutSpec:
    layers = 1 + max(p.layer for p in params if p.layer is not None)
    experts = num_experts(params)
    tp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([c for c in (1, 2) if tp * c <= WORLD]))
    pp = draw(st.sampled_from([d for d in (1, 2, 4) if layers % d == 0 and tp * cp * d <= WORLD]))
    vpp = draw(
        st.sampled_from([v for v in (1, 2) if v == 1 or (pp > 1 and layers % (pp * v) == 0)])
    )
    dp = draw(st.sampled_from([d for d in (1, 2, 4) if tp * cp * pp * d <= WORLD]))
    world = tp * cp * pp * dp
    choices = [(1, tp)] + [
        (ep, etp)
        for ep in (2, 4)
        for etp in sorted({1, tp})
        if experts and experts % ep == 0 and world % (etp * ep * pp) == 0
    ]
    ep, etp = draw(st.sampled_from(choices))
    ranks = draw(st.permutations(range(WORLD)))[:world]
    distopt = draw(st.booleans())
    master = draw(st.booleans())
    return LayoutSpec(
        ranks=tuple(ranks),
        tp=tp,
        pp=pp,
        dp=dp,
        context_parallel=cp,
        expert_parallel=ep,
        expert_tensor_parallel=etp,
        sequence_parallel=tp > 1 and draw(st.booleans()),
        virtual_pipeline=vpp if vpp > 1 else draw(st.sampled_from([None, 1])),
        distributed_optimizer=distopt,
        param_dtype="bfloat16" if master else "float32",
        master_dtype="float32" if master else None,
        bucket_size=draw(st.sampled_from([None, 40, 100])),
    )


def global_arrays(layout: Layout) -> dict[str, np.ndarray]:
    out = {}
    base = 0
    for t in layout.tensors:
        out[t.name] = np.arange(base, base + t.numel, dtype=np.int64).reshape(t.shape)
        base += t.numel
    return out


def megatron_local(full: np.ndarray, param: ParamSpec, tp: int, tp_rank: int) -> np.ndarray:
    """The local TP shard as Megatron's ``_initialize_affine_weight_cpu`` builds it."""
    if param.tp_dim is None:
        return full.copy()
    size = full.shape[param.tp_dim] // (tp * param.tp_stride)
    chunks = np.split(full, full.shape[param.tp_dim] // size, axis=param.tp_dim)
    return np.concatenate(chunks[tp_rank::tp], axis=param.tp_dim)


def model_chunk(param: ParamSpec, spec: LayoutSpec, layers: int) -> tuple[int, int]:
    """``(pp_rank, vp_stage)`` building ``param``: Megatron's ``get_transformer_layer_offset``
    (offset ``vp_stage * layers / vpp + pp_rank * layers / pp / vpp``)."""
    pp, vpp = spec.pp, spec.virtual_pipeline or 1
    if param.stage is Stage.FIRST:
        return 0, 0
    if param.stage is Stage.LAST:
        return pp - 1, vpp - 1
    assert param.layer is not None
    size = layers // (pp * vpp)
    for pp_rank in range(pp):
        for vp in range(vpp):
            offset = vp * (layers // vpp) + pp_rank * size
            if offset <= param.layer < offset + size:
                return pp_rank, vp
    raise AssertionError(param)


def rank_coords(spec: LayoutSpec, index: int, experts: int) -> dict[str, int]:
    """Megatron's rank equations: ``index = tp + tp*(cp + cp*(dp + dp*pp))`` for the dense
    generator, ``etp + etp*(ep + ep*(edp + edp*pp))`` for the expert one."""
    tp, cp, dp = spec.tp, spec.context_parallel, spec.dp
    etp = spec.expert_tensor_parallel or spec.tp
    ep = spec.expert_parallel
    edp = spec.world_size // (etp * ep * spec.pp)
    return {
        "tp": index % tp,
        "cp": index // tp % cp,
        "dp": index // (tp * cp) % dp,
        "pp": index // (tp * cp * dp),
        "etp": index % etp,
        "ep": index // etp % ep,
        "edp": index // (etp * ep) % edp,
        "etp_size": etp,
        "edp_size": edp,
        "local_experts": experts // ep if experts else 0,
    }


def rank_ranges(
    params: list[ParamSpec], spec: LayoutSpec, c: dict[str, int], owned: list[ParamSpec]
) -> dict[str, tuple[int, int]]:
    """Distributed-optimizer ranges: per model chunk a dense buffer over dp × cp (expert
    weights join it when ep = 1) and, with ep > 1, an expert buffer over expert DP."""
    layers = 1 + max(p.layer for p in params if p.layer is not None)
    out: dict[str, tuple[int, int]] = {}
    cp = spec.context_parallel
    for vp in range(spec.virtual_pipeline or 1):
        chunk = [p for p in owned if model_chunk(p, spec, layers) == (c["pp"], vp)]
        bucket = spec.bucket_size if c["pp"] == 0 and vp == 0 else None
        separate = spec.expert_parallel > 1
        parts = [
            (
                [p for p in chunk if not (separate and p.expert is not None)],
                spec.dp * cp,
                c["cp"] + cp * c["dp"],
            ),
            ([p for p in chunk if separate and p.expert is not None], c["edp_size"], c["edp"]),
        ]
        for members, size, group_rank in parts:
            buffer = dp_buffer(
                [
                    BufferParam(
                        name=p.name,
                        numel=math.prod(
                            local_shape(p, spec.tp if p.expert is None else c["etp_size"])
                        ),
                    )
                    for p in members
                ],
                dp=size,
                distributed_optimizer=True,
                bucket_size=bucket,
            )
            out |= dp_param_ranges(buffer, group_rank)
    return out


def expected_locals(
    params: list[ParamSpec], spec: LayoutSpec, arrays: dict[str, np.ndarray]
) -> dict[tuple[str, int], np.ndarray]:
    """Each rank's local arrays, built the Megatron way (not from the placements)."""
    layers = 1 + max(p.layer for p in params if p.layer is not None)
    out: dict[tuple[str, int], np.ndarray] = {}
    for index, rank in enumerate(spec.ranks):
        c = rank_coords(spec, index, num_experts(params))
        owned = [
            p
            for p in params
            if model_chunk(p, spec, layers)[0] == c["pp"]
            and (p.expert is None or p.expert // c["local_experts"] == c["ep"])
        ]
        ranges = rank_ranges(params, spec, c, owned)
        for p in owned:
            tp, tp_rank = (spec.tp, c["tp"]) if p.expert is None else (c["etp_size"], c["etp"])
            out[p.name, rank] = megatron_local(arrays[p.name], p, tp, tp_rank)
            states = ["exp_avg", "exp_avg_sq"] + (["main"] if spec.master_dtype else [])
            if spec.distributed_optimizer and p.name not in ranges:
                continue
            for s in states:
                state = megatron_local(arrays[f"{p.name}/{s}"], p, tp, tp_rank)
                if spec.distributed_optimizer:
                    start, stop = ranges[p.name]
                    state = state.reshape(-1)[start:stop]
                out[f"{p.name}/{s}", rank] = state
            out[f"{p.name}/step", rank] = arrays[f"{p.name}/step"].copy()
    return out


@given(st.data())
def test_placements_view_what_megatron_holds(data: st.DataObject) -> None:
    params = data.draw(models())
    spec = data.draw(layout_specs(params))
    layout = trainer_layout(params, spec)
    arrays = global_arrays(layout)
    local = expected_locals(params, spec, arrays)
    assert {(t, r) for t, r, _ in layout.local_shapes} == set(local)
    for tensor, rank, shape in layout.local_shapes:
        assert local[tensor, rank].shape == shape
    covered: dict[str, np.ndarray] = {t.name: np.zeros(t.shape, bool) for t in layout.tensors}
    painted: dict[tuple[str, int], np.ndarray] = {
        k: np.zeros(v.shape, int) for k, v in local.items()
    }
    for placement in layout.placements:
        shard = placement.shard
        view = placement.view(local[shard.tensor, shard.rank])
        np.testing.assert_array_equal(view, arrays[shard.tensor][shard.region.slices() or ...])
        placement.view(painted[shard.tensor, shard.rank])[...] += 1
        covered[shard.tensor][shard.region.slices() or ...] = True
    assert all((p == 1).all() for p in painted.values()), "placements do not tile local tensors"
    assert all(c.all() for c in covered.values()), "some element is held by no rank"
    if spec.distributed_optimizer:
        for p in params:
            if len(p.shape) == 2:
                boxes: dict[int, int] = defaultdict(int)
                for pl in layout.placements:
                    if pl.shard.tensor == f"{p.name}/exp_avg":
                        boxes[pl.shard.rank] += 1
                assert max(boxes.values()) <= 3 * p.tp_stride


def apply_plan(
    plan_layouts: tuple[Layout, Layout], src_local: dict[tuple[str, int], np.ndarray]
) -> tuple[dict[tuple[str, int], np.ndarray], int]:
    src, dst = plan_layouts
    plan = plan_reshard(dst.tensor_map(), src.shards, dst.shards)
    out = {(t, r): np.full(shape, -1, dtype=np.int64) for t, r, shape in dst.local_shapes}
    writes = {key: np.zeros(value.shape, dtype=np.int64) for key, value in out.items()}
    by_rank_src = defaultdict(list)
    for pl in src.placements:
        by_rank_src[pl.shard.tensor, pl.shard.rank].append(pl)
    by_rank_dst = defaultdict(list)
    for pl in dst.placements:
        by_rank_dst[pl.shard.tensor, pl.shard.rank].append(pl)
    for item in plan.items:
        (s,) = [
            p
            for p in by_rank_src[item.tensor, item.src_rank]
            if p.shard.region.contains(item.region)
        ]
        (d,) = [
            p
            for p in by_rank_dst[item.tensor, item.dst_rank]
            if p.shard.region.contains(item.region)
        ]
        piece = s.view(src_local[item.tensor, item.src_rank])[
            item.region.relative_to(s.shard.region).slices() or ...
        ]
        box = item.region.relative_to(d.shard.region).slices() or ...
        d.view(out[item.tensor, item.dst_rank])[box] = piece
        d.view(writes[item.tensor, item.dst_rank])[box] += 1
    for key, count in writes.items():
        assert (count == 1).all(), f"destination {key} not written exactly once"
    return out, plan.bytes_moved


def minimum_bytes(src: Layout, dst: Layout) -> int:
    held: dict[tuple[str, int], np.ndarray] = {}
    specs = src.tensor_map()
    for pl in src.placements:
        key = (pl.shard.tensor, pl.shard.rank)
        mask = held.setdefault(key, np.zeros(specs[pl.shard.tensor].shape, bool))
        mask[pl.shard.region.slices() or ...] = True
    total = 0
    for pl in dst.placements:
        mask = held.get((pl.shard.tensor, pl.shard.rank))
        need = np.ones(pl.shard.region.sizes, bool)
        if mask is not None:
            need &= ~mask[pl.shard.region.slices() or ...]
        total += int(need.sum()) * specs[pl.shard.tensor].itemsize
    return total


@given(st.data())
def test_planned_reshard_rebuilds_the_destination_layout(data: st.DataObject) -> None:
    params = data.draw(models())
    master = data.draw(st.booleans())
    first = data.draw(layout_specs(params))
    second = data.draw(layout_specs(params))
    dtypes = {"param_dtype": "bfloat16" if master else "float32"}
    dtypes["master_dtype"] = "float32" if master else None  # type: ignore[assignment]
    specs = [
        LayoutSpec(**{**{f: getattr(s, f) for f in LayoutSpec.__dataclass_fields__}, **dtypes})
        for s in (first, second)
    ]
    src, dst = (trainer_layout(params, s) for s in specs)
    arrays = global_arrays(src)
    src_local = expected_locals(params, specs[0], arrays)
    got, moved = apply_plan((src, dst), src_local)
    want = expected_locals(params, specs[1], arrays)
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=str(key))
    assert moved == minimum_bytes(src, dst)
