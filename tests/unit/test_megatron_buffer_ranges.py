"""dynarl.migrate._buffer reproduces Megatron's own DDP buffer and distributed-optimizer maps.

Megatron's real ``_ParamAndGradBuffer`` is built on CPU (the shim makes its
``torch.cuda.current_device()`` allocations land on CPU) with a stand-in data-parallel
group that answers ``rank()`` and ``size()`` (the only calls the buffer and the range map
make), for random parameter lists, DP sizes, bucket sizes, shared embeddings and padding
modes. Its ``param_index_map``, ``bucket_indices`` and
``DistributedOptimizer._build_gbuf_range_map`` (the ``"param"`` range of every parameter on
every DP rank) must equal what :func:`dp_buffer` and :func:`dp_param_ranges` compute.

Likewise for the rest of a layout's Megatron arithmetic: :meth:`LayoutSpec.group_ranks`
against ``parallel_state.RankGenerator`` (the dense generator over tp-cp-dp-pp and the
expert one over etp-ep-edp-pp, as ``initialize_model_parallel`` builds them), and
:func:`pipeline_chunks` against ``get_transformer_layer_offset`` and
``get_num_layers_to_build`` with and without a virtual pipeline.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from stub_group import StubGroup

from dynarl.backends._cpu_compat import apply_cpu_shim
from dynarl.migrate import BufferParam, LayoutSpec, ParamSpec, dp_buffer, dp_param_ranges
from dynarl.migrate._trainer_placement import pipeline_chunks

apply_cpu_shim()

# Importing Megatron's optimizer package compiles helpers with torch.jit (deprecated in
# torch 2.13) and re-exports a module Megatron itself marks as deprecated: third-party noise.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
    warnings.filterwarnings("ignore", "The following imports from `dynamic_context.py`")
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.parallel_state import RankGenerator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


def megatron_buffer(
    numels: list[int],
    shared: list[bool],
    *,
    dp: int,
    dp_rank: int,
    distopt: bool,
    bucket_size: int | None,
    pad: bool,
) -> tuple[Any, list[torch.nn.Parameter]]:
    params = []
    for numel, is_shared in zip(numels, shared, strict=True):
        param = torch.nn.Parameter(torch.zeros(numel))
        if is_shared:
            param.shared_embedding = True  # type: ignore[attr-defined]
        params.append(param)
    group = StubGroup(dp_rank, dp)
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=distopt, pad_buckets_for_high_nccl_busbw=pad
    )
    buffer = pgb._ParamAndGradBuffer(
        config,
        torch.float32,
        torch.float32,
        params,
        group,
        bucket_size,
        {p: f"p{i}" for i, p in enumerate(params)},
        1.0 / dp,
        list(range(len(params))),
        False,
        ProcessGroupCollection(tp=StubGroup(0, 1), dp_cp=group),
    )
    return buffer, params


@pytest.fixture(autouse=True)
def _quiet_buffer_log(monkeypatch: pytest.MonkeyPatch) -> None:
    # The buffer logs through a helper that asserts torch.distributed is initialised; the
    # layout arithmetic under test does not depend on it.
    monkeypatch.setattr(pgb, "log_on_each_pipeline_stage", lambda *a, **k: None)


@given(
    numels=st.lists(st.integers(1, 300), min_size=1, max_size=10),
    data=st.data(),
    dp=st.sampled_from([1, 2, 3, 4, 8]),
    distopt=st.booleans(),
    bucket_size=st.sampled_from([None, 50, 200, 1000]),
    pad=st.booleans(),
)
def test_buffer_and_dp_ranges_match_megatron(
    numels: list[int],
    data: st.DataObject,
    dp: int,
    distopt: bool,
    bucket_size: int | None,
    pad: bool,
) -> None:
    shared = data.draw(st.lists(st.booleans(), min_size=len(numels), max_size=len(numels)))
    pad = pad and distopt
    ours = dp_buffer(
        [
            BufferParam(name=f"p{i}", numel=n, shared_embedding=s)
            for i, (n, s) in enumerate(zip(numels, shared, strict=True))
        ],
        dp=dp,
        distributed_optimizer=distopt,
        bucket_size=bucket_size,
        pad_for_high_nccl_busbw=pad,
    )
    for dp_rank in range(dp if distopt else 1):
        buffer, params = megatron_buffer(
            numels,
            shared,
            dp=dp,
            dp_rank=dp_rank,
            distopt=distopt,
            bucket_size=bucket_size,
            pad=pad,
        )
        index = {f"p{i}": buffer.param_index_map[p] for i, p in enumerate(params)}
        assert {n: (s, e, b) for n, s, e, b in ours.param_ranges} == index
        assert list(ours.buckets) == list(buffer.bucket_indices)
        assert ours.numel == buffer.numel
        if not distopt:
            continue
        (per_bucket,) = DistributedOptimizer._build_gbuf_range_map(buffer).values()
        names = {id(p): f"p{i}" for i, p in enumerate(params)}
        theirs = {}
        for bucket in per_bucket:
            for param, ranges in bucket["param_map"].items():
                r = ranges["param"]
                theirs[names[id(param)]] = (r.start, r.end)
        assert dp_param_ranges(ours, dp_rank) == theirs


DENSE_TOKENS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "mp": "tp-pp", "dp_cp": "dp-cp"}
EXPERT_TOKENS = {"etp": "tp", "ep": "ep", "edp": "dp", "tp_ep": "tp-ep"}


@given(
    sizes=st.tuples(*(st.sampled_from([1, 2, 3]) for _ in range(4))),
    expert=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3])),
    data=st.data(),
)
def test_rank_groups_are_megatrons(
    sizes: tuple[int, int, int, int], expert: tuple[int, int], data: st.DataObject
) -> None:
    tp, cp, dp, pp = sizes
    ep, etp = expert
    world = tp * cp * dp * pp
    if ep == 1:
        etp = tp
    if world % (etp * ep * pp):
        return
    ranks = tuple(data.draw(st.permutations(range(world))))
    spec = LayoutSpec(
        ranks=ranks,
        tp=tp,
        pp=pp,
        dp=dp,
        context_parallel=cp,
        expert_parallel=ep,
        expert_tensor_parallel=etp,
    )
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    experts = RankGenerator(tp=etp, ep=ep, dp=spec.edp, pp=pp, cp=1, order=order)
    for generator, tokens in ((dense, DENSE_TOKENS), (experts, EXPERT_TOKENS)):
        for kind, token in tokens.items():
            want = [tuple(ranks[i] for i in group) for group in generator.get_ranks(token)]
            assert spec.group_ranks(kind) == want, kind


@pytest.mark.parametrize(
    ("layers", "pp", "vpp"), [(8, 2, None), (8, 2, 2), (8, 2, 4), (12, 4, 3), (6, 3, 2)]
)
def test_pipeline_chunks_are_megatrons(layers: int, pp: int, vpp: int | None) -> None:
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=8,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        cuda_graph_scope=[],  # the default ("full") warns that it is deprecated
    )
    want = {}
    for pp_rank in range(pp):
        for vp in range(vpp or 1):
            stage = vp if vpp else None
            first = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=pp_rank)
            count = get_num_layers_to_build(config, vp_stage=stage, pp_rank=pp_rank)
            want |= {f"l{n}": (pp_rank, vp) for n in range(first, first + count)}
    params = [ParamSpec(name=f"l{n}", shape=(2,), layer=n) for n in range(layers)]
    spec = LayoutSpec(ranks=tuple(range(pp)), pp=pp, virtual_pipeline=vpp)
    assert pipeline_chunks(params, spec) == want
