"""trainer_layout: place every parameter and its Adam state on the ranks of a LayoutSpec.

The arithmetic behind :class:`~dynarl.migrate.Layout`: TP boxes (Megatron's strided
split), PP stage assignment (layers split evenly, embeddings first, output last), and the
distributed optimizer's flat DP ranges turned into boxes in each parameter's coordinates.
Pure functions; run anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from dynarl.migrate._buffer import BufferParam, dp_buffer, dp_param_ranges
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

__all__ = ["local_shape", "trainer_layout"]


def trainer_layout(params: Sequence[ParamSpec], spec: LayoutSpec) -> Layout:
    """Shards of every parameter and of its Adam state under ``spec``.

    ``params`` in the model's registration order (``named_parameters``), which fixes the
    distributed optimizer's buffer order. Raises ValueError naming the parameter when a
    TP-split dimension is not divisible by ``tp * tp_stride``, and naming ``pipeline`` when
    the layers do not split evenly into ``pp`` stages or tied embeddings meet ``pp > 1``.
    """
    stage_of = _stage_assignment(params, spec.pp)
    tensors = _tensor_specs(params, spec)
    placements: list[Placement] = []
    shapes: list[tuple[str, int, tuple[int, ...]]] = []
    for pp_rank in range(spec.pp):
        local = [p for p in params if stage_of[p.name] == pp_rank]
        buffer = None
        if spec.distributed_optimizer:
            buffer = dp_buffer(
                [_buffer_param(p, spec.tp) for p in local],
                dp=spec.dp,
                distributed_optimizer=True,
                bucket_size=spec.bucket_size if pp_rank == 0 else None,
                pad_for_high_nccl_busbw=spec.pad_buckets_for_high_nccl_busbw,
            )
        for dp_rank in range(spec.dp):
            ranges = dp_param_ranges(buffer, dp_rank) if buffer is not None else None
            for tp_rank in range(spec.tp):
                rank = spec.rank(tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank)
                for param in local:
                    _place_param(param, spec, tp_rank, rank, ranges, placements, shapes)
    name = f"tp{spec.tp}-pp{spec.pp}-dp{spec.dp}" + (
        "-distopt" if spec.distributed_optimizer else ""
    )
    return Layout(
        name=name,
        ranks=tuple(sorted(spec.ranks)),
        tensors=tensors,
        placements=tuple(placements),
        local_shapes=tuple(shapes),
        spec=spec,
    )


def _stage_assignment(params: Sequence[ParamSpec], pp: int) -> dict[str, int]:
    layers = [p.layer for p in params if p.layer is not None]
    num_layers = max(layers) + 1 if layers else 0
    if pp > 1 and (num_layers < pp or num_layers % pp):
        raise ValueError(f"pipeline: {num_layers} layers do not split evenly into {pp} stages")
    if pp > 1 and any(p.shared_embedding for p in params):
        raise ValueError("pipeline: tied (shared) embeddings with pp > 1 are not supported yet")
    per_stage = num_layers // pp if pp > 1 else max(num_layers, 1)
    out = {}
    for p in params:
        if p.stage is Stage.FIRST:
            out[p.name] = 0
        elif p.stage is Stage.LAST:
            out[p.name] = pp - 1
        else:
            assert p.layer is not None
            out[p.name] = min(p.layer // per_stage, pp - 1)
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


def _buffer_param(param: ParamSpec, tp: int) -> BufferParam:
    numel = math.prod(local_shape(param, tp))
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
    tp_rank: int,
    rank: int,
    ranges: dict[str, tuple[int, int]] | None,
    placements: list[Placement],
    shapes: list[tuple[str, int, tuple[int, ...]]],
) -> None:
    shape = local_shape(param, spec.tp)
    whole = Region(offsets=(0,) * len(shape), sizes=shape)
    states = (["main"] if spec.master_dtype is not None else []) + list(OPTIMIZER_STATES)
    _place_shaped(param, spec, tp_rank, rank, param.name, whole, placements)
    shapes.append((param.name, rank, shape))
    if ranges is None:
        for state in states:
            _place_shaped(
                param, spec, tp_rank, rank, state_tensor(param.name, state), whole, placements
            )
            shapes.append((state_tensor(param.name, state), rank, shape))
    elif param.name in ranges:
        start, stop = ranges[param.name]
        for state in states:
            name = state_tensor(param.name, state)
            shapes.append((name, rank, (stop - start,)))
            for box in flat_range_boxes(shape, start, stop):
                for piece in _to_global(param, spec.tp, tp_rank, box):
                    first = _local_flat_index(param, spec.tp, tp_rank, piece, shape)
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
    spec: LayoutSpec,
    tp_rank: int,
    rank: int,
    name: str,
    whole: Region,
    placements: list[Placement],
) -> None:
    for piece in _to_global(param, spec.tp, tp_rank, whole):
        local = _to_local(param, spec.tp, piece)
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
