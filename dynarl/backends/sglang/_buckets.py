"""Flattened weight buckets as SGLang's ``load_format="flattened_bucket"`` receives them.

For one ``/update_weights_from_distributed`` call SGLang allocates one ``uint8`` buffer and
splits it by the request's ``names``/``dtypes``/``shapes`` in order, with no padding, and
refuses a tensor whose byte offset is not a multiple of its element size
(``weight_sync/tensor_bucket.py`` ``FlattenedTensorBucket.empty``). So a bucket here lists
its tensors by decreasing element size, which keeps every offset aligned, and
:func:`plan_buckets` packs tensors greedily under a byte limit (a tensor larger than the
limit travels alone). Pure functions plus two tensor helpers; run on any rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Bucket",
    "TensorMeta",
    "dtype_from_name",
    "flatten_bucket",
    "plan_buckets",
    "tensor_meta",
    "unflatten_bucket",
]


def dtype_from_name(name: str) -> torch.dtype:
    """``torch.<name>`` as SGLang resolves a dtype string; ValueError if there is none."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype name {name!r}")
    return dtype


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorMeta:
    """Name, dtype and shape of one full tensor, as SGLang's request lists them."""

    name: str
    """HF parameter name."""
    dtype: str
    """``torch`` dtype name without the module (``"bfloat16"``)."""
    shape: tuple[int, ...]
    """Full shape."""

    def __post_init__(self) -> None:
        dtype_from_name(self.dtype)
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"{self.name}: negative dimension in {self.shape}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return dtype_from_name(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.itemsize


def tensor_meta(name: str, tensor: torch.Tensor) -> TensorMeta:
    """The :class:`TensorMeta` of ``tensor`` under ``name``."""
    return TensorMeta(
        name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=tuple(tensor.shape)
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    """The tensors of one broadcast, in buffer order (decreasing element size)."""

    tensors: tuple[TensorMeta, ...]
    """Members in the order they sit in the flat buffer."""

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("a bucket needs at least one tensor")
        offset = 0
        for meta in self.tensors:
            if offset % meta.itemsize:
                raise ValueError(f"{meta.name} would start at unaligned byte offset {offset}")
            offset += meta.nbytes

    @property
    def names(self) -> list[str]:
        """The request's ``names``."""
        return [meta.name for meta in self.tensors]

    @property
    def dtypes(self) -> list[str]:
        """The request's ``dtypes``."""
        return [meta.dtype for meta in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        """The request's ``shapes``."""
        return [list(meta.shape) for meta in self.tensors]

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer."""
        return sum(meta.nbytes for meta in self.tensors)


def plan_buckets(metas: Sequence[TensorMeta], *, max_bucket_bytes: int) -> tuple[Bucket, ...]:
    """Pack tensors into buckets of at most ``max_bucket_bytes`` (one oversize tensor alone).

    Deterministic: tensors are taken by decreasing element size, then in the given order.
    Raises ValueError for a non-positive limit or duplicate names.
    """
    if max_bucket_bytes <= 0:
        raise ValueError(f"max_bucket_bytes must be > 0, got {max_bucket_bytes}")
    names = [meta.name for meta in metas]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique within one sync")
    ordered = sorted(metas, key=lambda meta: -meta.itemsize)
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    size = 0
    for meta in ordered:
        if current and size + meta.nbytes > max_bucket_bytes:
            buckets.append(Bucket(tensors=tuple(current)))
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        buckets.append(Bucket(tensors=tuple(current)))
    return tuple(buckets)


def flatten_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's flat ``uint8`` buffer; ValueError if a tensor disagrees with its meta."""
    parts = []
    for meta in bucket.tensors:
        tensor = tensors[meta.name]
        if tensor_meta(meta.name, tensor) != meta:
            raise ValueError(f"{meta.name}: tensor {tensor.dtype} {tuple(tensor.shape)} != {meta}")
        parts.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def unflatten_bucket(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's tensors in ``flat`` (SGLang's ``reconstruct_tensors``)."""
    if flat.dtype != torch.uint8 or flat.numel() != bucket.nbytes:
        raise ValueError(f"flat buffer must be uint8 of {bucket.nbytes} bytes")
    out = []
    offset = 0
    for meta in bucket.tensors:
        chunk = flat[offset : offset + meta.nbytes]
        out.append((meta.name, chunk.view(dtype_from_name(meta.dtype)).reshape(meta.shape)))
        offset += meta.nbytes
    return out
