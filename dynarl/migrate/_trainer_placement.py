"""trainer_layout: place every parameter and its Adam state on the ranks of a LayoutSpec.

The arithmetic behind :class:`~dynarl.migrate.Layout`, as Megatron-core 0.16.1 does it:

- TP boxes: Megatron's strided split, over TP for dense parameters and over expert TP
  for expert ones.
- PP and virtual PP (:func:`pipeline_chunks`): ``transformer_layer.py``,
  ``get_transformer_layer_offset``: the layers are cut into ``pp * vpp`` equal chunks,
  chunk ``k`` built by pipeline rank ``k % pp`` as its virtual stage ``k // pp``;
  embeddings go to the first chunk, the final norm and output layer to the last.
- EP: the experts module (``moe/experts.py``) of expert-parallel rank ``r`` holds global
  experts ``r * n .. r * n + n - 1`` with ``n = num_experts / ep``.
- Distributed optimizer: DDP (``distributed/distributed_data_parallel.py``) keeps one
  buffer per model chunk for dense parameters, over the ``intra_dp_cp`` group (dp × cp
  ranks, group rank ``cp_rank + cp * dp_rank``), and, when ``ep > 1`` (expert weights are
  then ``allreduce=False``), a separate one for the chunk's expert parameters over the
  expert-data-parallel group. Buckets exist only in the first chunk of the first stage
  (Megatron-LM builds later chunks with ``disable_bucketing``); each buffer's flat ranges
  come from :mod:`._buffer`.

Pure functions; run anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from dynarl.migrate._buffer import BufferParam, DPBuffer, dp_buffer, dp_param_ranges
from dynarl.migrate._layout import (
    OPTIMIZER_STATES,
    Layout,
    LayoutSpec,
    ParamSpec,
    Placement,
    Stage,
    state_tensor,
)
from dynarl.migrate._region import Region, Shard, TensorSpec, flat_range_boxes

__all__ = ["local_shape", "pipeline_chunks", "trainer_layout"]

_Ranges = dict[str, tuple[int, int]]


def trainer_layout(params: Sequence[ParamSpec], spec: LayoutSpec) -> Layout:
    """Shards of every parameter and of its Adam state under ``spec``.

    ``params`` in the model's registration order (``named_parameters``, experts numbered
    globally as a model with ``ep = 1`` registers them), which fixes the distributed
    optimizer's buffer order. Raises ValueError naming the parameter when a TP-split
    dimension is not divisible by ``tp * tp_stride`` (``etp`` for experts), naming
    ``pipeline`` when the layers do not split evenly into ``pp * vpp`` chunks or tied
    embeddings meet ``pp > 1``, and naming ``expert_parallel`` when the experts do not
    split evenly over ``ep`` ranks or ``ep > 1`` meets a model without experts.
    """
    chunks = pipeline_chunks(params, spec)
    per_rank = _experts_per_rank(params, spec.ep)
    tensors = _tensor_specs(params, spec)
    placements: list[Placement] = []
    shapes: list[tuple[str, int, tuple[int, ...]]] = []
    buffers: dict[tuple[int, int, int | None], DPBuffer] = {}
    for rank in spec.ranks:
        pp_rank, ep_rank = spec.coord(rank, "pp"), spec.coord(rank, "ep")
        mine = [
            p
            for p in params
            if chunks[p.name][0] == pp_rank
            and (p.expert is None or p.expert // per_rank == ep_rank)
        ]
        ranges = None
        if spec.distributed_optimizer:
            ranges = _rank_ranges(mine, spec, rank, chunks, buffers)
        for param in mine:
            if param.expert is None:
                tp, tp_rank = spec.tp, spec.coord(rank, "tp")
            else:
                tp, tp_rank = spec.etp, spec.coord(rank, "etp")
            _place_param(param, spec, tp, tp_rank, rank, ranges, placements, shapes)
    return Layout(
        name=_layout_name(spec),
        ranks=tuple(sorted(spec.ranks)),
        tensors=tensors,
        placements=tuple(placements),
        local_shapes=tuple(shapes),
        spec=spec,
    )


def _layout_name(spec: LayoutSpec) -> str:
    name = f"tp{spec.tp}-pp{spec.pp}-dp{spec.dp}"
    extras = [
        (spec.cp > 1, f"-cp{spec.cp}"),
        (spec.ep > 1, f"-ep{spec.ep}"),
        (spec.etp != spec.tp, f"-etp{spec.etp}"),
        (spec.vpp > 1, f"-vpp{spec.vpp}"),
        (spec.sequence_parallel, "-sp"),
        (spec.distributed_optimizer, "-distopt"),
    ]
    return name + "".join(text for used, text in extras if used)


def pipeline_chunks(params: Sequence[ParamSpec], spec: LayoutSpec) -> dict[str, tuple[int, int]]:
    """``{name: (pp_rank, virtual_stage)}``: the model chunk that builds each parameter.

    Transformer layers are cut into ``pp * vpp`` equal chunks in order; chunk ``k`` is
    virtual stage ``k // pp`` of pipeline rank ``k % pp`` (Megatron's interleaved
    assignment; without a virtual pipeline, stage ``k`` holds chunk ``k``). Embeddings sit
    in chunk ``(0, 0)``, the final norm and output layer in ``(pp - 1, vpp - 1)``. Raises
    ValueError naming ``pipeline`` when the layers do not split evenly or tied embeddings
    meet ``pp > 1``.
    """
    layers = [p.layer for p in params if p.layer is not None]
    num_layers = max(layers) + 1 if layers else 0
    pp, vpp = spec.pp, spec.vpp
    if pp * vpp > 1 and (num_layers < pp * vpp or num_layers % (pp * vpp)):
        into = f"{pp} stages" + (f" x {vpp} virtual stages" if vpp > 1 else "")
        raise ValueError(f"pipeline: {num_layers} layers do not split evenly into {into}")
    if pp > 1 and any(p.shared_embedding for p in params):
        raise ValueError("pipeline: tied (shared) embeddings with pp > 1 are not supported yet")
    per_chunk = num_layers // (pp * vpp) if pp * vpp > 1 else max(num_layers, 1)
    out = {}
    for p in params:
        if p.stage is Stage.FIRST:
            out[p.name] = (0, 0)
        elif p.stage is Stage.LAST:
            out[p.name] = (pp - 1, vpp - 1)
        else:
            assert p.layer is not None
            chunk = min(p.layer // per_chunk, pp * vpp - 1)
            out[p.name] = (chunk % pp, chunk // pp)
    return out


def _experts_per_rank(params: Sequence[ParamSpec], ep: int) -> int:
    experts = {p.expert for p in params if p.expert is not None}
    if not experts:
        if ep > 1:
            raise ValueError(f"expert_parallel: ep={ep} but the model has no expert parameters")
        return 1
    num_experts = max(experts) + 1
    if num_experts % ep:
        raise ValueError(
            f"expert_parallel: {num_experts} experts do not split evenly over ep={ep} ranks"
        )
    return num_experts // ep


def _rank_ranges(
    mine: Sequence[ParamSpec],
    spec: LayoutSpec,
    rank: int,
    chunks: dict[str, tuple[int, int]],
    buffers: dict[tuple[int, int, int | None], DPBuffer],
) -> _Ranges:
    """The distributed optimizer's range of each parameter ``rank`` holds state for."""
    pp_rank = spec.coord(rank, "pp")
    dense_rank = spec.coord(rank, "cp") + spec.cp * spec.coord(rank, "dp")
    ep_rank = spec.coord(rank, "ep")
    out: _Ranges = {}
    for vp in range(spec.vpp):
        chunk = [p for p in mine if chunks[p.name] == (pp_rank, vp)]
        bucket_size = spec.bucket_size if pp_rank == 0 and vp == 0 else None
        separate = spec.ep > 1
        groups: list[tuple[int | None, list[ParamSpec], int, int]] = [
            (
                None,
                [p for p in chunk if not (separate and p.expert is not None)],
                spec.dp * spec.cp,
                dense_rank,
            )
        ]
        if separate:
            experts = [p for p in chunk if p.expert is not None]
            groups.append((ep_rank, experts, spec.edp, spec.coord(rank, "edp")))
        for key, members, size, group_rank in groups:
            buffer = buffers.get((pp_rank, vp, key))
            if buffer is None:
                buffer = buffers[pp_rank, vp, key] = dp_buffer(
                    [_buffer_param(p, spec) for p in members],
                    dp=size,
                    distributed_optimizer=True,
                    bucket_size=bucket_size,
                    pad_for_high_nccl_busbw=spec.pad_buckets_for_high_nccl_busbw,
                )
            out |= dp_param_ranges(buffer, group_rank)
    return out


def _tensor_specs(params: Sequence[ParamSpec], spec: LayoutSpec) -> tuple[TensorSpec, ...]:
    state_dtype = spec.master_dtype or spec.param_dtype
    out = []
    for p in params:
        out.append(TensorSpec(name=p.name, shape=p.shape, dtype=spec.param_dtype))
        if spec.master_dtype is not None:
            out.append(
                TensorSpec(
                    name=state_tensor(p.name, "main"), shape=p.shape, dtype=spec.master_dtype
                )
            )
        out.extend(
            TensorSpec(name=state_tensor(p.name, state), shape=p.shape, dtype=state_dtype)
            for state in OPTIMIZER_STATES
        )
        out.append(TensorSpec(name=state_tensor(p.name, "step"), shape=(), dtype="float32"))
    return tuple(out)


def local_shape(param: ParamSpec, tp: int) -> tuple[int, ...]:
    """Shape of ``param`` on one TP rank; ValueError when the split is uneven."""
    if param.tp_dim is None:
        return param.shape
    size = param.shape[param.tp_dim]
    if size % (tp * param.tp_stride):
        raise ValueError(
            f"tensor parallel: dim {param.tp_dim} of {param.name!r} (size {size}) is not "
            f"divisible by tp={tp} x stride={param.tp_stride}"
        )
    shape = list(param.shape)
    shape[param.tp_dim] = size // tp
    return tuple(shape)


def _buffer_param(param: ParamSpec, spec: LayoutSpec) -> BufferParam:
    numel = math.prod(local_shape(param, spec.tp if param.expert is None else spec.etp))
    return BufferParam(name=param.name, numel=numel, shared_embedding=param.shared_embedding)


def _to_global(param: ParamSpec, tp: int, tp_rank: int, box: Region) -> Iterator[Region]:
    """Split a box of the local tensor into boxes of the global tensor (stride chunks)."""
    if param.tp_dim is None:
        yield box
        return
    dim = param.tp_dim
    chunk = param.shape[dim] // (tp * param.tp_stride)
    lo, hi = box.offsets[dim], box.offsets[dim] + box.sizes[dim]
    for k in range(lo // chunk, -(-hi // chunk)):
        a, b = max(lo, k * chunk), min(hi, (k + 1) * chunk)
        start = (k * tp + tp_rank) * chunk + (a - k * chunk)
        offsets = (*box.offsets[:dim], start, *box.offsets[dim + 1 :])
        sizes = (*box.sizes[:dim], b - a, *box.sizes[dim + 1 :])
        yield Region(offsets=offsets, sizes=sizes)


def _place_param(
    param: ParamSpec,
    spec: LayoutSpec,
    tp: int,
    tp_rank: int,
    rank: int,
    ranges: dict[str, tuple[int, int]] | None,
    placements: list[Placement],
    shapes: list[tuple[str, int, tuple[int, ...]]],
) -> None:
    shape = local_shape(param, tp)
    whole = Region(offsets=(0,) * len(shape), sizes=shape)
    states = (["main"] if spec.master_dtype is not None else []) + list(OPTIMIZER_STATES)
    _place_shaped(param, tp, tp_rank, rank, param.name, whole, placements)
    shapes.append((param.name, rank, shape))
    if ranges is None:
        for state in states:
            _place_shaped(
                param, tp, tp_rank, rank, state_tensor(param.name, state), whole, placements
            )
            shapes.append((state_tensor(param.name, state), rank, shape))
    elif param.name in ranges:
        start, stop = ranges[param.name]
        for state in states:
            name = state_tensor(param.name, state)
            shapes.append((name, rank, (stop - start,)))
            for box in flat_range_boxes(shape, start, stop):
                for piece in _to_global(param, tp, tp_rank, box):
                    first = _local_flat_index(param, tp, tp_rank, piece, shape)
                    shard = Shard(tensor=name, rank=rank, region=piece)
                    placements.append(Placement(shard=shard, flat_offset=first - start))
    else:
        return
    step = state_tensor(param.name, "step")
    scalar = Region(offsets=(), sizes=())
    placements.append(Placement(shard=Shard(tensor=step, rank=rank, region=scalar), local=scalar))
    shapes.append((step, rank, ()))


def _place_shaped(
    param: ParamSpec,
    tp: int,
    tp_rank: int,
    rank: int,
    name: str,
    whole: Region,
    placements: list[Placement],
) -> None:
    for piece in _to_global(param, tp, tp_rank, whole):
        local = _to_local(param, tp, piece)
        placements.append(Placement(shard=Shard(tensor=name, rank=rank, region=piece), local=local))


def _to_local(param: ParamSpec, tp: int, piece: Region) -> Region:
    """The local box of a global box that lies inside one of this rank's TP chunks."""
    if param.tp_dim is None:
        return piece
    dim = param.tp_dim
    chunk = param.shape[dim] // (tp * param.tp_stride)
    start = piece.offsets[dim]
    k = (start // chunk) // tp
    local_start = k * chunk + start % chunk
    return Region(
        offsets=(*piece.offsets[:dim], local_start, *piece.offsets[dim + 1 :]), sizes=piece.sizes
    )


def _local_flat_index(
    param: ParamSpec, tp: int, tp_rank: int, piece: Region, local_shape: tuple[int, ...]
) -> int:
    corner = _to_local(param, tp, piece).offsets
    index = 0
    for c, n in zip(corner, local_shape, strict=True):
        index = index * n + c
    return index
