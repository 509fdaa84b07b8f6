"""Trainer layouts: how every parameter and its Adam state are split over ranks.

A layout is pure data. :func:`~dynarl.migrate.trainer_layout` turns a model
description (one :class:`ParamSpec` per parameter, in registration order) and a
:class:`LayoutSpec` (tp, pp, dp, ranks, distributed optimizer, dtypes) into
:class:`Placement` s: for every rank, which box of which tensor it holds and where that box
sits in the rank's local tensor. Tensors are the parameters themselves plus
``<param>/exp_avg``, ``<param>/exp_avg_sq``, ``<param>/step`` and, with an fp32 master copy,
``<param>/main``. TP splits a parameter along its partition dimension (Megatron's strided
split when ``tp_stride > 1``), PP assigns layers to stages, DP replicates parameters and
either replicates the optimizer state or, with the distributed optimizer, gives each DP rank
a contiguous range of the flat buffer (:mod:`._buffer`), at most three boxes per 2-D
parameter. :func:`replicated_layout` describes full copies on every rank (weight sync to
rollout engines).

Context, expert, sequence and virtual-pipeline parallelism are refused with a ValueError
naming the dimension. Pure functions; run anywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar

from dynarl.migrate._region import Region, Shard, TensorSpec, dtype_size
from dynarl.types import ParallelDims

__all__ = [
    "OPTIMIZER_STATES",
    "Layout",
    "LayoutSpec",
    "ParamSpec",
    "Placement",
    "Sliceable",
    "Stage",
    "replicated_layout",
    "state_tensor",
]

OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")
"""Adam moments, stored per element like the parameter (suffixes of their tensor names)."""


def state_tensor(param: str, state: str) -> str:
    """Name of optimizer tensor ``state`` (``exp_avg``, ``step``, ``main``...) of ``param``."""
    return f"{param}/{state}"


class Sliceable(Protocol):
    """What :meth:`Placement.view` needs of a local tensor (torch.Tensor, numpy.ndarray)."""

    def __getitem__(self, index: Any) -> Self: ...

    def reshape(self, *shape: int) -> Self: ...


ArrayT = TypeVar("ArrayT", bound=Sliceable)


class Stage(enum.StrEnum):
    """Which pipeline stage holds a parameter."""

    FIRST = "first"
    """The first stage (embeddings)."""
    LAST = "last"
    """The last stage (final norm, output layer)."""
    LAYER = "layer"
    """The stage holding transformer layer ``ParamSpec.layer``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamSpec:
    """One model parameter, unsharded, as a layout needs it."""

    name: str
    """Global name (transformer layers numbered globally, from 0)."""
    shape: tuple[int, ...]
    """Full shape."""
    tp_dim: int | None = None
    """Dimension split across TP ranks; None when every TP rank holds a full copy."""
    tp_stride: int = 1
    """Megatron's ``partition_stride``: the split interleaves this many chunks per rank."""
    stage: Stage = Stage.LAYER
    """Pipeline placement."""
    layer: int | None = None
    """Global transformer layer index, required when ``stage`` is LAYER."""
    shared_embedding: bool = False
    """Megatron's ``shared_embedding`` flag (tied input/output embeddings)."""

    def __post_init__(self) -> None:
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(self.shape):
            raise ValueError(f"ParamSpec {self.name!r}: tp_dim {self.tp_dim} outside its shape")
        if self.tp_stride < 1 or (self.tp_stride > 1 and self.tp_dim != 0):
            raise ValueError(f"ParamSpec {self.name!r}: tp_stride > 1 is supported on dim 0 only")
        if (self.stage is Stage.LAYER) != (self.layer is not None):
            raise ValueError(f"ParamSpec {self.name!r}: layer must be set iff stage is 'layer'")


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutSpec:
    """A trainer parallel layout: sizes, ranks and optimizer sharding."""

    ranks: tuple[int, ...]
    """Global ranks in Megatron order (TP fastest, then DP, then PP); tp * dp * pp of them."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    dp: int = 1
    """Data-parallel size."""
    distributed_optimizer: bool = False
    """Whether optimizer state is sharded over DP ranks (flat buffer ranges)."""
    param_dtype: str = "float32"
    """Dtype of the model parameters."""
    master_dtype: str | None = None
    """Dtype of the optimizer's master copy (``"float32"``), or None for no master copy."""
    bucket_size: int | None = None
    """DDP bucket size in elements on the first PP stage; None for one bucket."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """Megatron's option of the same name (pads buckets to 2**16 elements)."""
    context_parallel: int = 1
    """Context-parallel size: only 1 is supported."""
    expert_parallel: int = 1
    """Expert-parallel size: only 1 is supported."""
    sequence_parallel: bool = False
    """Sequence parallelism: not supported."""
    virtual_pipeline: int | None = None
    """Virtual pipeline (interleaved) size: not supported."""

    def __post_init__(self) -> None:
        unsupported = {
            "context_parallel": self.context_parallel != 1,
            "expert_parallel": self.expert_parallel != 1,
            "sequence_parallel": self.sequence_parallel,
            "virtual_pipeline": self.virtual_pipeline not in (None, 1),
        }
        for dimension, used in unsupported.items():
            if used:
                raise ValueError(f"layouts with {dimension} are not supported yet")
        ParallelDims(tp=self.tp, pp=self.pp, dp=self.dp)
        if len(self.ranks) != self.tp * self.pp * self.dp:
            raise ValueError(f"{len(self.ranks)} ranks given for tp*pp*dp = {self.world_size}")
        if len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ValueError(f"layout ranks must be distinct and >= 0, got {self.ranks}")
        dtype_size(self.param_dtype)
        if self.master_dtype is not None:
            dtype_size(self.master_dtype)
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 or None, got {self.bucket_size}")

    @property
    def world_size(self) -> int:
        """Ranks the layout uses."""
        return self.tp * self.pp * self.dp

    def rank(self, *, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank at these coordinates."""
        return self.ranks[tp_rank + self.tp * (dp_rank + self.dp * pp_rank)]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank; ValueError if not in the layout."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not part of layout {self.ranks}")
        index = self.ranks.index(rank)
        return index % self.tp, (index // self.tp) % self.dp, index // (self.tp * self.dp)

    def group_ranks(self, kind: str) -> list[tuple[int, ...]]:
        """Ranks of every ``"tp"``, ``"dp"``, ``"pp"`` or ``"mp"`` (tp × pp) group."""
        varying = {"tp": (0,), "dp": (1,), "pp": (2,), "mp": (0, 2)}.get(kind)
        if varying is None:
            raise ValueError(f"unknown group kind {kind!r}; expected tp, dp, pp or mp")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in self.ranks:
            coords = self.coords(rank)
            fixed = tuple(c for i, c in enumerate(coords) if i not in varying)
            groups.setdefault(fixed, []).append(rank)
        return [tuple(g) for g in groups.values()]


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where one shard lives on its rank: a box of the local tensor, or a 1-D range of it."""

    shard: Shard
    """The shard, in global coordinates."""
    local: Region | None = None
    """Its box in the rank's local tensor (same sizes as the shard), for shaped tensors."""
    flat_offset: int | None = None
    """Start of its elements in the rank's 1-D local tensor (distributed optimizer state)."""

    def __post_init__(self) -> None:
        if (self.local is None) == (self.flat_offset is None):
            raise ValueError("a Placement needs exactly one of local and flat_offset")

    def view(self, local: ArrayT) -> ArrayT:
        """The shard's elements as a view of ``local`` (the rank's local tensor), shaped
        like the shard's region; writes through to ``local``."""
        if self.local is not None:
            return local[self.local.slices() or ...]
        assert self.flat_offset is not None
        region = self.shard.region
        return local[self.flat_offset : self.flat_offset + region.numel].reshape(*region.sizes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Every tensor of a trainer state, its shards and their local placement."""

    name: str
    """Human-readable description, e.g. ``"tp2-pp1-dp2"``."""
    ranks: tuple[int, ...]
    """Ranks holding at least one shard."""
    tensors: tuple[TensorSpec, ...]
    """Every tensor, in a stable order."""
    placements: tuple[Placement, ...]
    """Every shard with its local placement."""
    local_shapes: tuple[tuple[str, int, tuple[int, ...]], ...]
    """``(tensor, rank, shape)`` of each rank's local tensor."""
    spec: LayoutSpec | None = None
    """The trainer layout it was built from (None for a replicated layout)."""

    @property
    def shards(self) -> tuple[Shard, ...]:
        """Every shard."""
        return tuple(p.shard for p in self.placements)

    def tensor_map(self) -> dict[str, TensorSpec]:
        """``{name: spec}``."""
        return {t.name: t for t in self.tensors}

    def placements_on(self, rank: int) -> tuple[Placement, ...]:
        """Placements held by ``rank``."""
        return tuple(p for p in self.placements if p.shard.rank == rank)

    def local_shapes_on(self, rank: int) -> dict[str, tuple[int, ...]]:
        """``{tensor: local shape}`` of the local tensors on ``rank``."""
        return {t: s for t, r, s in self.local_shapes if r == rank}


def replicated_layout(
    params: Sequence[ParamSpec], ranks: Sequence[int], dtype: str = "float32"
) -> Layout:
    """Full copies of every parameter (no optimizer state) on every rank of ``ranks``."""
    tensors = tuple(TensorSpec(name=p.name, shape=p.shape, dtype=dtype) for p in params)
    placements = []
    shapes = []
    for rank in ranks:
        for t in tensors:
            shard = Shard(tensor=t.name, rank=rank, region=t.full())
            placements.append(Placement(shard=shard, local=t.full()))
            shapes.append((t.name, rank, t.shape))
    return Layout(
        name=f"replicated-{len(ranks)}",
        ranks=tuple(sorted(ranks)),
        tensors=tensors,
        placements=tuple(placements),
        local_shapes=tuple(shapes),
    )
