"""Where Megatron's distributed optimizer puts each parameter: flat buffers and DP ranges.

Megatron-core (0.16.1) packs a model chunk's parameters into one flat buffer per dtype
(``distributed/param_and_grad_buffer.py``, ``_ParamAndGradBuffer.__init__``): parameters
in *reverse* registration order, each start padded to a multiple of 64 elements when the
distributed optimizer is on, buckets closed once they hold ``bucket_size`` elements (and
around shared embeddings), each bucket end padded to ``lcm(dp, 128)`` (``lcm(dp, 128,
2**16)`` with ``pad_buckets_for_high_nccl_busbw``). The distributed optimizer
(``optimizer/distrib_optimizer.py``, ``_build_model_gbuf_range``) then gives DP rank ``d``
the ``d``-th of ``dp`` equal slices of every bucket, and each parameter the part of its
flat range inside that slice. This module recomputes both, without torch, so that a layout
can be planned before any buffer exists; tests check it against Megatron's own maps.

Pure functions; run anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BufferParam", "DPBuffer", "dp_buffer", "dp_param_ranges"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferParam:
    """One parameter of a model chunk, as the DDP buffer sees it."""

    name: str
    """Parameter name (any unique key)."""
    numel: int
    """Elements of the local (TP-sharded) parameter."""
    shared_embedding: bool = False
    """Megatron's ``param.shared_embedding`` (tied embedding under PP): own bucket."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DPBuffer:
    """A model chunk's flat buffer: parameter ranges and bucket bounds, in elements."""

    param_ranges: tuple[tuple[str, int, int, int], ...]
    """``(name, start, end, bucket)`` per parameter, in buffer order."""
    buckets: tuple[tuple[int, int], ...]
    """``(start, end)`` of each bucket, padded."""
    dp: int
    """Data-parallel size the buffer is padded for."""
    distributed_optimizer: bool
    """Whether starts and bucket ends are padded (distributed optimizer on)."""

    @property
    def numel(self) -> int:
        """Padded size of the whole buffer."""
        return self.buckets[-1][1] if self.buckets else 0


def dp_buffer(
    params: Sequence[BufferParam],
    *,
    dp: int,
    distributed_optimizer: bool,
    bucket_size: int | None,
    pad_for_high_nccl_busbw: bool = False,
) -> DPBuffer:
    """Lay ``params`` (in registration order) out in one flat buffer as Megatron's DDP does.

    ``bucket_size`` is the value DDP passes to the buffer: None when buckets are disabled
    (no ``overlap_grad_reduce``, or pipeline stages after the first). Raises ValueError
    when ``dp`` or ``bucket_size`` is not positive.
    """
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if bucket_size is not None and bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1 or None, got {bucket_size}")
    divisor = math.lcm(dp, 128, 2**16) if pad_for_high_nccl_busbw else math.lcm(dp, 128)

    def pad_bucket_end(index: int) -> int:
        return _pad(index, divisor) if distributed_optimizer else index

    def pad_param_start(index: int) -> int:
        return _pad(index, 64) if distributed_optimizer else index

    ranges: list[tuple[str, int, int, int]] = []
    buckets: list[tuple[int, int]] = []
    start = bucket_start = 0
    in_bucket = 0
    end = 0
    for param in reversed(params):
        own_bucket = param.shared_embedding and distributed_optimizer
        start = pad_param_start(start)
        if own_bucket and in_bucket:
            start = pad_bucket_end(start)
            buckets.append((bucket_start, start))
            bucket_start, in_bucket = start, 0
        end = start + param.numel
        ranges.append((param.name, start, end, len(buckets)))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = pad_bucket_end(end)
            buckets.append((bucket_start, start))
            bucket_start, in_bucket = start, 0
        else:
            start = end
    if in_bucket:
        buckets.append((bucket_start, pad_bucket_end(end)))
    return DPBuffer(
        param_ranges=tuple(ranges),
        buckets=tuple(buckets),
        dp=dp,
        distributed_optimizer=distributed_optimizer,
    )


def dp_param_ranges(buffer: DPBuffer, dp_rank: int) -> dict[str, tuple[int, int]]:
    """The flat range of each parameter that DP rank ``dp_rank`` owns, in the parameter.

    Returns ``{name: (start, end)}`` with offsets into the flattened local parameter, only
    for parameters the rank owns a non-empty part of (Megatron's ``"param"`` range).
    Raises ValueError when ``dp_rank`` is outside ``[0, dp)`` or the buffer was laid out
    without the distributed optimizer (its buckets are not split across DP ranks).
    """
    if not 0 <= dp_rank < buffer.dp:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {buffer.dp})")
    if not buffer.distributed_optimizer:
        raise ValueError("DP ranges exist only for a distributed-optimizer buffer")
    out: dict[str, tuple[int, int]] = {}
    for bucket_index, (bucket_start, bucket_end) in enumerate(buffer.buckets):
        share = (bucket_end - bucket_start) // buffer.dp
        lo = bucket_start + dp_rank * share
        hi = min(bucket_end, lo + share)
        for name, start, end, bucket in buffer.param_ranges:
            if bucket != bucket_index:
                continue
            first, last = max(start, lo), min(end, hi)
            if last > first:
                out[name] = (first - start, last - start)
    return out


def _pad(number: int, divisor: int) -> int:
    return -(-number // divisor) * divisor
