"""Boxes in a tensor's global index space: the vocabulary every layout and plan is written in.

A :class:`TensorSpec` names a logical tensor of the trainer state (a parameter, one of its
optimizer moments, its step counter) with its full, unsharded shape. A :class:`Region` is a
box in that tensor's index space; a :class:`Shard` says that one rank holds one box of one
tensor. Every layout (TP splits, PP stages, DP replicas, flat distributed-optimizer ranges)
is a list of shards, so two layouts of the same tensors always share coordinates.

Pure data and arithmetic: no torch, no I/O. Runs anywhere (controller or rank).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DTYPE_SIZES",
    "Region",
    "Shard",
    "TensorSpec",
    "box_difference",
    "dtype_size",
    "flat_range_boxes",
]

DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "bool": 1,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "int8": 1,
    "uint8": 1,
}
"""Bytes per element of every dtype name a :class:`TensorSpec` accepts (torch's names)."""

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""Internal form of a region: (inclusive lower corner, exclusive upper corner)."""


def dtype_size(dtype: str) -> int:
    """Bytes per element of ``dtype``; raises ValueError naming an unknown dtype."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """A logical tensor of the trainer state, unsharded."""

    name: str
    """Unique name, e.g. ``"decoder.layers.0.mlp.linear_fc1.weight/exp_avg"``."""
    shape: tuple[int, ...]
    """Full (global) shape; ``()`` for a scalar such as a step counter."""
    dtype: str
    """Element type as torch names it (``"float32"``, ``"bfloat16"``, ...)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TensorSpec.name must not be empty")
        if any(not isinstance(n, int) or n < 0 for n in self.shape):
            raise ValueError(f"TensorSpec {self.name!r}: shape {self.shape} must be ints >= 0")
        dtype_size(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.numel * self.itemsize

    def full(self) -> Region:
        """The region covering the whole tensor."""
        return Region(offsets=(0,) * len(self.shape), sizes=self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    """A box ``[offsets, offsets + sizes)`` in a tensor's global index space."""

    offsets: tuple[int, ...]
    """Lower corner, one entry per dimension (``()`` for a scalar)."""
    sizes: tuple[int, ...]
    """Extent along each dimension, >= 0."""
    ends: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Exclusive upper corner (derived)."""

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"Region offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise ValueError(f"Region offsets {self.offsets} and sizes {self.sizes} must be >= 0")
        object.__setattr__(self, "ends", tuple(map(int.__add__, self.offsets, self.sizes)))

    @classmethod
    def from_box(cls, box: Box) -> Region:
        """Build from the internal (lower, upper) form."""
        lo, hi = box
        return cls(offsets=lo, sizes=tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)))

    @property
    def box(self) -> Box:
        """The internal (lower, upper) form."""
        return self.offsets, self.ends

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.sizes)

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar region)."""
        return math.prod(self.sizes)

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether the region lies inside a tensor of ``shape``."""
        return len(shape) == self.ndim and all(
            e <= n for e, n in zip(self.ends, shape, strict=True)
        )

    def intersect(self, other: Region) -> Region | None:
        """The common box, or None when the two do not overlap (or either is empty)."""
        box = intersect_boxes(self.box, other.box)
        return None if box is None else Region.from_box(box)

    def contains(self, other: Region) -> bool:
        """Whether ``other`` lies entirely inside this region."""
        return all(
            a <= b and d <= c
            for a, b, c, d in zip(self.offsets, other.offsets, self.ends, other.ends, strict=True)
        )

    def relative_to(self, outer: Region) -> Region:
        """This region in ``outer``'s local coordinates; ``outer`` must contain it."""
        assert outer.contains(self), (self, outer)
        return Region(
            offsets=tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)),
            sizes=self.sizes,
        )

    def slices(self) -> tuple[slice, ...]:
        """Index this region out of an array with ``array[region.slices()]``."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    def __str__(self) -> str:
        dims = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True))
        return f"[{dims}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """Rank ``rank`` holds ``region`` of tensor ``tensor``."""

    tensor: str
    """Name of the :class:`TensorSpec`."""
    rank: int
    """Global rank (device id) holding the data."""
    region: Region
    """The box it holds, in the tensor's global coordinates."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"Shard of {self.tensor!r}: rank must be >= 0, got {self.rank}")


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """Intersection of two internal boxes, or None when it is empty."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x, y) for x, y in zip(a[1], b[1], strict=True))
    if any(h <= l_ for l_, h in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def box_numel(box: Box) -> int:
    """Number of elements of an internal box."""
    return math.prod(h - lo for lo, h in zip(box[0], box[1], strict=True))


def box_difference(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as at most ``2 * ndim`` disjoint boxes (guillotine cuts)."""
    cut = intersect_boxes(a, b)
    if cut is None:
        return [a] if box_numel(a) > 0 else []
    out: list[Box] = []
    lo, hi = list(a[0]), list(a[1])
    for dim in range(len(lo)):
        if lo[dim] < cut[0][dim]:
            out.append((tuple(lo), tuple([*hi[:dim], cut[0][dim], *hi[dim + 1 :]])))
            lo[dim] = cut[0][dim]
        if cut[1][dim] < hi[dim]:
            out.append((tuple([*lo[:dim], cut[1][dim], *lo[dim + 1 :]]), tuple(hi)))
            hi[dim] = cut[1][dim]
    return out


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> tuple[Region, ...]:
    """The row-major flat range ``[start, stop)`` of a tensor of ``shape`` as boxes.

    A range of a 2-D tensor is at most three boxes (partial first row, whole rows, partial
    last row); of an n-D tensor at most ``2n - 1``. Boxes come in flat order. Raises
    ValueError when the range is outside ``[0, numel]`` or reversed.
    """
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of shape {tuple(shape)}")
    return tuple(Region.from_box(box) for box in _flat_boxes(tuple(shape), start, stop))


def _flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> Iterator[Box]:
    if start >= stop:
        return
    if len(shape) <= 1:
        yield (start,) * len(shape), (stop,) * len(shape)
        return
    inner_shape = shape[1:]
    inner = math.prod(inner_shape)
    first, first_off = divmod(start, inner)
    last, last_off = divmod(stop, inner)
    if first == last:
        for lo, hi in _flat_boxes(inner_shape, first_off, last_off):
            yield (first, *lo), (first + 1, *hi)
        return
    if first_off:
        for lo, hi in _flat_boxes(inner_shape, first_off, inner):
            yield (first, *lo), (first + 1, *hi)
        first += 1
    if first < last:
        yield (first,) + (0,) * len(inner_shape), (last, *inner_shape)
    if last_off:
        for lo, hi in _flat_boxes(inner_shape, 0, last_off):
            yield (last, *lo), (last + 1, *hi)
