"""Weight sync trainer → SGLang engines, as SGLang 0.5.23 takes it.

The trainer's broadcasting rank is rank 0 of a process group the engines join through
``/init_weights_update_group`` (an engine's TP rank ``t`` is ``rank_offset + t``). The group
is built exactly as SGLang builds it (``utils/common.py`` ``init_custom_process_group``:
TCP rendezvous, a ``PrefixStore`` named after the group), so both sides agree on the keys.
Then, inside ``/begin_weight_update`` … ``/end_weight_update``, each bucket is one
``/update_weights_from_distributed`` call (``load_format="flattened_bucket"``) on every
engine, paired with one ``broadcast(src=0)`` of the flat buffer; the HTTP call returns once
the engine has received and loaded it, so both run concurrently. Finally
``/weights_checker`` proves the weights landed (:mod:`._weight_check`).

:func:`plan_weight_sync` is pure; :func:`push_weights` executes a plan on the trainer's
event loop (torch.distributed calls run in worker threads and are polled, so the loop never
blocks). NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from dynarl.backends.sglang._buckets import (
    Bucket,
    TensorMeta,
    dtype_from_name,
    flatten_bucket,
    plan_buckets,
    tensor_meta,
    unflatten_bucket,
)
from dynarl.backends.sglang._client import SGLangClient
from dynarl.backends.sglang._http_wire import ControlResult
from dynarl.errors import BackendError

__all__ = [
    "WeightSyncConfig",
    "WeightSyncPlan",
    "broadcast_bucket",
    "close_update_group",
    "open_update_group",
    "plan_weight_sync",
    "push_weights",
    "receive_bucket",
    "receive_tensor",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncConfig:
    """How the trainer pushes weights to its engines."""

    master_address: str
    """Address of the trainer's broadcasting rank, reachable from every engine."""
    master_port: int
    """Free TCP port there for the group's rendezvous store."""
    group_name: str = "weight_update_group"
    """Process-group name (SGLang's default)."""
    backend: str = "nccl"
    """``nccl`` on GPU, ``gloo`` on CPU."""
    max_bucket_bytes: int = 512 * 1024 * 1024
    """Upper bound on one broadcast's buffer (a larger tensor travels alone)."""
    weight_version: str | None = None
    """Version label the engines report after the sync."""
    group_timeout_s: float = 300.0
    """Deadline for the rendezvous and for each broadcast."""

    def __post_init__(self) -> None:
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if self.max_bucket_bytes <= 0:
            raise ValueError(f"max_bucket_bytes must be > 0, got {self.max_bucket_bytes}")
        if self.group_timeout_s <= 0:
            raise ValueError(f"group_timeout_s must be > 0, got {self.group_timeout_s}")
        if not self.group_name:
            raise ValueError("group_name must be non-empty")


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncPlan:
    """Who joins the group at which rank, and which buckets are broadcast in which order."""

    rank_offsets: tuple[int, ...]
    """Per engine, its TP rank 0's rank in the group (the trainer is rank 0)."""
    world_size: int
    """Trainer rank plus every engine TP rank."""
    buckets: tuple[Bucket, ...]
    """Broadcast order."""


def plan_weight_sync(
    tensors: Mapping[str, torch.Tensor],
    *,
    engine_tp_sizes: Sequence[int],
    max_bucket_bytes: int,
) -> WeightSyncPlan:
    """Ranks and buckets for pushing full HF-named ``tensors`` to engines of these TP sizes.

    Raises ValueError for no engines, a non-positive TP size or no tensors.
    """
    if not engine_tp_sizes or any(size < 1 for size in engine_tp_sizes):
        raise ValueError(f"engine_tp_sizes must be positive and non-empty, got {engine_tp_sizes}")
    if not tensors:
        raise ValueError("nothing to sync")
    offsets = []
    next_rank = 1
    for size in engine_tp_sizes:
        offsets.append(next_rank)
        next_rank += size
    metas = [tensor_meta(name, tensor) for name, tensor in tensors.items()]
    return WeightSyncPlan(
        rank_offsets=tuple(offsets),
        world_size=next_rank,
        buckets=plan_buckets(metas, max_bucket_bytes=max_bucket_bytes),
    )


# ---------------------------------------------------------------------- process group


def open_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> ProcessGroup:
    """Join the weight-update group the way SGLang's ``init_custom_process_group`` does.

    Blocking (rendezvous with every member); call it from a worker thread. Rank 0 hosts the
    TCP store. Raises RuntimeError/TimeoutError from torch.distributed on failure.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )
    from torch.distributed.rendezvous import rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group: ProcessGroup
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=cast(Any, group_name),
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    logger.info("joined weight-update group %s as rank %d/%d", group_name, rank, world_size)
    return group


def close_update_group(group: ProcessGroup) -> None:
    """Destroy a group made by :func:`open_update_group` (blocking)."""
    dist.destroy_process_group(group)


async def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    """Await a collective without blocking the loop: its future wakes an asyncio event."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def wake(_: object) -> None:
        # Runs on a torch.distributed thread; the loop may be gone after a timeout.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(done.set)

    work.get_future().add_done_callback(wake)
    try:
        async with asyncio.timeout(timeout_s):
            await done.wait()
    except TimeoutError as exc:
        raise BackendError(f"{what} did not complete within {timeout_s} s") from exc
    work.wait()


async def broadcast_bucket(group: ProcessGroup, flat: torch.Tensor, timeout_s: float) -> None:
    """Broadcast one flat bucket from rank 0 (the trainer side)."""
    work = dist.broadcast(flat, src=0, group=group, async_op=True)
    assert work is not None
    await _wait(work, timeout_s, "weight broadcast")


async def receive_bucket(
    group: ProcessGroup, bucket: Bucket, timeout_s: float, device: str = "cpu"
) -> list[tuple[str, torch.Tensor]]:
    """Receive one flat bucket from rank 0 and split it (the engine side)."""
    flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    work = dist.broadcast(flat, src=0, group=group, async_op=True)
    assert work is not None
    await _wait(work, timeout_s, "weight receive")
    return unflatten_bucket(bucket, flat)


async def receive_tensor(
    group: ProcessGroup, meta: TensorMeta, timeout_s: float, device: str = "cpu"
) -> torch.Tensor:
    """Receive one whole tensor broadcast from rank 0 (SGLang's non-bucketed format)."""
    tensor = torch.empty(meta.shape, dtype=dtype_from_name(meta.dtype), device=device)
    work = dist.broadcast(tensor, src=0, group=group, async_op=True)
    assert work is not None
    await _wait(work, timeout_s, "weight receive")
    return tensor


# ---------------------------------------------------------------------- the HTTP sequence


def _failures(results: Sequence[ControlResult | BaseException]) -> list[str]:
    failed = []
    for index, result in enumerate(results):
        if isinstance(result, BaseException):
            failed.append(f"engine {index}: {result!r}")
        elif not result.success:
            failed.append(f"engine {index}: {result.message}")
    return failed


def _check(results: Sequence[ControlResult | BaseException], what: str) -> None:
    failed = _failures(results)
    if failed:
        raise BackendError(f"{what} failed: {'; '.join(failed)}")


async def _each(
    calls: Sequence[Coroutine[Any, Any, ControlResult]],
) -> list[ControlResult | BaseException]:
    """Run one call per engine concurrently; every call completes (failures returned)."""
    return list(await asyncio.gather(*calls, return_exceptions=True))


async def _best_effort(calls: Sequence[Coroutine[Any, Any, ControlResult]], what: str) -> None:
    for failure in _failures(await _each(calls)):
        logger.warning("%s: %s", what, failure)


async def push_weights(
    clients: Sequence[SGLangClient],
    tensors: Mapping[str, torch.Tensor],
    plan: WeightSyncPlan,
    config: WeightSyncConfig,
) -> None:
    """Push ``tensors`` to every engine along ``plan``; the trainer's rank 0 runs this.

    Sequence: group init (engines and trainer together) → ``begin_weight_update`` → per
    bucket ``update_weights_from_distributed`` on every engine paired with the broadcast →
    ``end_weight_update`` → group destroyed (also on failure). Pause or drain the engines
    first: an engine that is serving makes each update wait for its in-flight requests
    (SGLang's writer lock). Raises BackendError when an
    engine refuses a step or a collective times out (an engine that refuses to join leaves
    the trainer's rendezvous waiting until ``group_timeout_s``); the engines then hold
    partly updated weights and must be synced again.
    """
    if len(clients) != len(plan.rank_offsets):
        raise ValueError(f"{len(clients)} clients for {len(plan.rank_offsets)} planned engines")
    local = asyncio.to_thread(
        open_update_group,
        master_address=config.master_address,
        master_port=config.master_port,
        rank=0,
        world_size=plan.world_size,
        group_name=config.group_name,
        backend=config.backend,
        timeout_s=config.group_timeout_s,
    )
    joins = [
        client.init_weights_update_group(
            master_address=config.master_address,
            master_port=config.master_port,
            rank_offset=offset,
            world_size=plan.world_size,
            group_name=config.group_name,
            backend=config.backend,
        )
        for client, offset in zip(clients, plan.rank_offsets, strict=True)
    ]
    outcomes = await asyncio.gather(local, *joins, return_exceptions=True)
    opened = cast(ProcessGroup | BaseException, outcomes[0])
    failed = _failures(cast(list[ControlResult | BaseException], outcomes[1:]))
    if isinstance(opened, BaseException) or failed:
        if not isinstance(opened, BaseException):
            await asyncio.to_thread(close_update_group, opened)
        await _best_effort(
            [client.destroy_weights_update_group(config.group_name) for client in clients],
            "destroy_weights_update_group",
        )
        cause = opened if isinstance(opened, BaseException) else None
        raise BackendError(
            f"init_weights_update_group failed: {failed or [repr(cause)]}"
        ) from cause
    group = opened
    try:
        await _push_in_session(clients, tensors, plan, config, group)
    finally:
        await _best_effort(
            [client.destroy_weights_update_group(config.group_name) for client in clients],
            "destroy_weights_update_group",
        )
        await asyncio.to_thread(close_update_group, group)
    logger.info("pushed %d buckets to %d engines", len(plan.buckets), len(clients))


async def _push_in_session(
    clients: Sequence[SGLangClient],
    tensors: Mapping[str, torch.Tensor],
    plan: WeightSyncPlan,
    config: WeightSyncConfig,
    group: ProcessGroup,
) -> None:
    _check(await _each([client.begin_weight_update() for client in clients]), "begin_weight_update")
    try:
        for index, bucket in enumerate(plan.buckets):
            last = index == len(plan.buckets) - 1
            flat = flatten_bucket(bucket, tensors)
            if config.backend == "nccl":
                flat = flat.cuda()
            updates = [
                client.update_weights_from_distributed(
                    names=bucket.names,
                    dtypes=bucket.dtypes,
                    shapes=bucket.shapes,
                    group_name=config.group_name,
                    load_format="flattened_bucket",
                    flush_cache=last,
                    weight_version=config.weight_version if last else None,
                )
                for client in clients
            ]
            outcomes = await asyncio.gather(
                broadcast_bucket(group, flat, config.group_timeout_s),
                *updates,
                return_exceptions=True,
            )
            sent = outcomes[0]
            results = cast(list[ControlResult | BaseException], outcomes[1:])
            _check(results, f"update_weights_from_distributed #{index}")
            if isinstance(sent, BaseException):
                raise BackendError(f"broadcast of bucket #{index} failed: {sent!r}") from sent
    except BaseException:
        await _best_effort([client.end_weight_update() for client in clients], "end_weight_update")
        raise
    _check(await _each([client.end_weight_update() for client in clients]), "end_weight_update")
