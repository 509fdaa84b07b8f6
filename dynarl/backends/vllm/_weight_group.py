"""The process group a weight push travels over, built the same way on both sides.

The pushing side (rank 0) hosts a TCPStore on a free port; each engine worker (ranks
1..n) joins it as a client, and both build :func:`dynarl.migrate.build_group` over it
(gloo on CPU, NCCL on GPU). What crosses the HTTP call is :class:`GroupSpec` and
:class:`PushSpec` as JSON text (vLLM's ``/collective_rpc`` passes strings only).
Imported by the worker extension inside vLLM's worker process, so it needs only torch
and dynarl.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from dynarl.migrate import CommGroup, build_group

__all__ = [
    "GroupSpec",
    "PushSpec",
    "TensorSpec",
    "host_store",
    "join_group",
    "receive_tensors",
    "send_tensors",
]


class GroupSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how a weight-push group meets."""

    name: str
    """The group's name (unique per push group)."""
    host: str
    """Address of the pushing side's TCPStore."""
    port: int
    rank: int
    """The joining worker's rank in the group (the pushing side is 0)."""
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"group {self.name}: rank {self.rank} not in [0, {self.world_size})")


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of a push, by HF name."""

    name: str
    dtype: str
    """``torch`` dtype name without the prefix (``"float32"``)."""
    shape: tuple[int, ...]


class PushSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The tensors one push broadcasts, in order."""

    tensors: tuple[TensorSpec, ...]


def host_store(host: str, timeout_s: float) -> TCPStore:
    """The pushing side's TCPStore on a free port of ``host`` (``store.port`` says which)."""
    timeout = timedelta(seconds=timeout_s)
    return TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)


def join_group(spec: GroupSpec, store: TCPStore | None = None) -> CommGroup:
    """Build the push group as ``spec.rank``: over ``store`` (the pushing side's own), or as
    a client of the store at ``spec.host:spec.port``. Blocks until every rank has joined."""
    timeout = timedelta(seconds=spec.timeout_s)
    if store is None:
        store = TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
    return build_group(
        store,
        name=spec.name,
        ranks=tuple(range(spec.world_size)),
        rank=spec.rank,
        backend=spec.backend,
        timeout=timeout,
    )


def push_spec(tensors: Mapping[str, torch.Tensor]) -> PushSpec:
    """The :class:`PushSpec` of ``tensors`` (in their order)."""
    return PushSpec(
        tensors=tuple(
            TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            for name, t in tensors.items()
        )
    )


def send_tensors(group: CommGroup, tensors: Mapping[str, torch.Tensor]) -> int:
    """Broadcast ``tensors`` from rank 0, in order; the bytes sent."""
    sent = 0
    for tensor in tensors.values():
        data = tensor.detach().contiguous()
        dist.broadcast(data, group=group.pg, group_src=0)
        sent += data.numel() * data.element_size()
    return sent


def receive_tensors(
    group: CommGroup, spec: PushSpec, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive the tensors of ``spec`` broadcast from rank 0, one at a time (lazily: the
    engine loads each before the next arrives)."""
    for item in spec.tensors:
        dtype = getattr(torch, item.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {item.name}: unknown dtype {item.dtype!r}")
        tensor = torch.empty(item.shape, dtype=dtype, device=device)
        dist.broadcast(tensor, group=group.pg, group_src=0)
        yield item.name, tensor
