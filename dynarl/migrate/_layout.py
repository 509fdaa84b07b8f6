"""Trainer layouts: how every parameter and its Adam state are split over ranks.

A layout is pure data. :func:`~dynarl.migrate.trainer_layout` turns a model
description (one :class:`ParamSpec` per parameter, in registration order) and a
:class:`LayoutSpec` (tp, cp, pp, dp, ep, etp, ranks, distributed optimizer, dtypes) into
:class:`Placement` s: for every rank, which box of which tensor it holds and where that box
sits in the rank's local tensor. Tensors are the parameters themselves plus
``<param>/exp_avg``, ``<param>/exp_avg_sq``, ``<param>/step`` and, with an fp32 master copy,
``<param>/main``. TP splits a parameter along its partition dimension (Megatron's strided
split when ``tp_stride > 1``), PP assigns layers to stages (and, with a virtual pipeline, to
interleaved model chunks), CP and DP replicate parameters, EP gives each expert to one
expert-parallel rank and ETP splits it. The optimizer state is replicated like its
parameter or, with the distributed optimizer, each data-parallel rank gets a contiguous
range of the flat buffer (:mod:`._buffer`), at most three boxes per 2-D parameter: dense
buffers are sharded over dp × cp, expert buffers over the expert-data-parallel group.
Sequence parallelism is a flag of TP that changes no placement.
:func:`replicated_layout` describes full copies on every rank (weight sync to rollout
engines).

Ranks follow Megatron-core's rank generators (``parallel_state.RankGenerator``, order
``tp-cp-ep-dp-pp``): the dense one over (tp, cp, dp, pp), the expert one over the same ranks
as (etp, ep, edp, pp) with ``edp = world / (etp * ep * pp)``. Pure functions; run anywhere.
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
    expert: int | None = None
    """Global index of the expert this parameter belongs to (a MoE expert's weight: held
    by one expert-parallel rank, split by expert TP over ``tp_dim``); None when dense."""

    def __post_init__(self) -> None:
        if self.expert is not None and (self.expert < 0 or self.stage is not Stage.LAYER):
            raise ValueError(
                f"ParamSpec {self.name!r}: expert must be >= 0 and belong to a layer, "
                f"got expert={self.expert}, stage={self.stage}"
            )
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(self.shape):
            raise ValueError(f"ParamSpec {self.name!r}: tp_dim {self.tp_dim} outside its shape")
        if self.tp_stride < 1 or (self.tp_stride > 1 and self.tp_dim != 0):
            raise ValueError(f"ParamSpec {self.name!r}: tp_stride > 1 is supported on dim 0 only")
        if (self.stage is Stage.LAYER) != (self.layer is not None):
            raise ValueError(f"ParamSpec {self.name!r}: layer must be set iff stage is 'layer'")


_DENSE_DIMS = ("tp", "cp", "dp", "pp")
_EXPERT_DIMS = ("etp", "ep", "edp", "pp")
_GROUP_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tp": (_DENSE_DIMS, ("tp",)),
    "cp": (_DENSE_DIMS, ("cp",)),
    "dp": (_DENSE_DIMS, ("dp",)),
    "pp": (_DENSE_DIMS, ("pp",)),
    "mp": (_DENSE_DIMS, ("tp", "pp")),
    "dp_cp": (_DENSE_DIMS, ("cp", "dp")),
    "tp_cp": (_DENSE_DIMS, ("tp", "cp")),
    "etp": (_EXPERT_DIMS, ("etp",)),
    "ep": (_EXPERT_DIMS, ("ep",)),
    "edp": (_EXPERT_DIMS, ("edp",)),
    "tp_ep": (_EXPERT_DIMS, ("etp", "ep")),
    "tp_ep_pp": (_EXPERT_DIMS, ("etp", "ep", "pp")),
}
"""Group kind: (the rank generator's dimensions, fastest first; the dimensions it spans)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutSpec:
    """A trainer parallel layout: sizes, ranks and optimizer sharding.

    Raises ValueError naming what is wrong: a size below one, a rank count other than
    ``tp * cp * dp * pp``, repeated or negative ranks, a world size not divisible by
    ``etp * ep * pp``, an expert TP other than TP without expert parallelism, sequence
    parallelism without TP, or a virtual pipeline without PP (Megatron refuses the last two).
    """

    ranks: tuple[int, ...]
    """Global ranks in Megatron order (TP fastest, then CP, DP, PP); tp*cp*dp*pp of them."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    dp: int = 1
    """Data-parallel size (without CP: Megatron's ``data_parallel_size``)."""
    distributed_optimizer: bool = False
    """Whether optimizer state is sharded over data-parallel ranks (flat buffer ranges)."""
    param_dtype: str = "float32"
    """Dtype of the model parameters."""
    master_dtype: str | None = None
    """Dtype of the optimizer's master copy (``"float32"``), or None for no master copy."""
    bucket_size: int | None = None
    """DDP bucket size in elements on the first model chunk of the first PP stage; None
    for one bucket."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """Megatron's option of the same name (pads buckets to 2**16 elements)."""
    context_parallel: int = 1
    """Context-parallel size: parameters are replicated over CP ranks; the distributed
    optimizer shards dense state over dp × cp (Megatron's dp-cp group)."""
    expert_parallel: int = 1
    """Expert-parallel size: each EP rank holds ``num_experts / ep`` experts."""
    expert_tensor_parallel: int | None = None
    """Expert-tensor-parallel size (splits each expert's weights); None for ``tp``."""
    sequence_parallel: bool = False
    """Sequence parallelism: a flag of TP that places every parameter as without it."""
    virtual_pipeline: int | None = None
    """Model chunks per pipeline stage (interleaved schedule); None for one."""

    def __post_init__(self) -> None:
        ParallelDims(tp=self.tp, pp=self.pp, dp=self.dp)
        sizes = {"context_parallel": self.context_parallel, "expert_parallel": self.ep}
        sizes |= {"expert_tensor_parallel": self.etp, "virtual_pipeline": self.vpp}
        for field, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LayoutSpec.{field} must be a positive int, got {value!r}")
        if len(self.ranks) != self.world_size:
            raise ValueError(f"{len(self.ranks)} ranks given for tp*cp*dp*pp = {self.world_size}")
        if len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ValueError(f"layout ranks must be distinct and >= 0, got {self.ranks}")
        self._check_expert_and_flags()
        dtype_size(self.param_dtype)
        if self.master_dtype is not None:
            dtype_size(self.master_dtype)
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 or None, got {self.bucket_size}")

    def _check_expert_and_flags(self) -> None:
        if self.world_size % (self.etp * self.ep * self.pp):
            raise ValueError(
                f"expert_parallel: world size {self.world_size} is not divisible by "
                f"etp*ep*pp = {self.etp}*{self.ep}*{self.pp}"
            )
        if self.ep == 1 and self.etp != self.tp:
            # With ep = 1 Megatron marks expert weights allreduce=True: they join the dense
            # buffers, reduced over dp × cp, which misses the replicas expert TP adds.
            raise ValueError(
                f"expert_tensor_parallel={self.etp} differs from tp={self.tp} without "
                "expert_parallel > 1: not supported"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1 (Megatron refuses it with tp=1)")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("virtual_pipeline > 1 needs pp > 1 (an interleaved schedule)")

    @property
    def world_size(self) -> int:
        """Ranks the layout uses."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def cp(self) -> int:
        """Context-parallel size."""
        return self.context_parallel

    @property
    def ep(self) -> int:
        """Expert-parallel size."""
        return self.expert_parallel

    @property
    def etp(self) -> int:
        """Expert-tensor-parallel size (``tp`` unless set)."""
        return self.tp if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: ``world / (etp * ep * pp)``."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline stage (1 without a virtual pipeline)."""
        return 1 if self.virtual_pipeline is None else self.virtual_pipeline

    def _sizes(self, dims: tuple[str, ...]) -> list[int]:
        return [int(getattr(self, d)) for d in dims]

    def rank(self, *, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """Global rank at these coordinates."""
        return self.ranks[tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank; ValueError if not in the layout."""
        return self.coord(rank, "tp"), self.coord(rank, "dp"), self.coord(rank, "pp")

    def coord(self, rank: int, dim: str) -> int:
        """Coordinate of global ``rank`` along ``dim``: ``tp``, ``cp``, ``dp``, ``pp`` (the
        dense generator) or ``etp``, ``ep``, ``edp`` (the expert generator).

        Raises ValueError for a rank outside the layout or an unknown dimension.
        """
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not part of layout {self.ranks}")
        dims = _DENSE_DIMS if dim in _DENSE_DIMS else _EXPERT_DIMS
        if dim not in dims:
            raise ValueError(f"unknown dimension {dim!r}; expected one of tp cp dp pp etp ep edp")
        index = self.ranks.index(rank)
        for name, size in zip(dims, self._sizes(dims), strict=True):
            if name == dim:
                return index % size
            index //= size
        raise AssertionError(dim)

    def group_ranks(self, kind: str) -> list[tuple[int, ...]]:
        """Ranks of every group of ``kind``, as Megatron's rank generators list them.

        Kinds: ``tp``, ``cp``, ``dp``, ``pp``, ``mp`` (tp × pp), ``dp_cp``, ``tp_cp`` (dense
        generator) and ``etp``, ``ep``, ``edp``, ``tp_ep``, ``tp_ep_pp`` (expert generator;
        the last is where Megatron sums expert gradient norms). Groups come
        in Megatron's order, each in group-rank order. Raises ValueError for another kind.
        """
        if kind not in _GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; expected one of {sorted(_GROUP_KINDS)}")
        dims, spanned = _GROUP_KINDS[kind]
        sizes = self._sizes(dims)
        groups: dict[int, dict[int, int]] = {}
        for index, rank in enumerate(self.ranks):
            inner = outer = 0
            inner_scale = outer_scale = 1
            rest = index
            for name, size in zip(dims, sizes, strict=True):
                rest, coord = divmod(rest, size)
                if name in spanned:
                    inner, inner_scale = inner + coord * inner_scale, inner_scale * size
                else:
                    outer, outer_scale = outer + coord * outer_scale, outer_scale * size
            groups.setdefault(outer, {})[inner] = rank
        return [tuple(g[i] for i in sorted(g)) for _, g in sorted(groups.items())]


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
