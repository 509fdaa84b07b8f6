"""``WeightPusher``: push a trainer's tensors (HF names) into running vLLM engines.

The pushing process is rank 0 of a group it hosts (:mod:`._weight_group`); every worker of
every engine joins it through the worker extension
(:class:`~dynarl.backends.vllm.worker_extension.WeightReceiver`, called over
``/collective_rpc``). One push is: pause the engines in place (``keep``), broadcast the
tensors while each worker loads them with vLLM's ``reload_weights``, drop the prefix cache
(KV computed under the old weights would otherwise be reused: ``docs/engines.md``), set the
weight-version label, resume. Requests paused in place continue under the new weights; their
tokens' version spans say where. Blocking collectives run on a thread; the rest on the
caller's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import torch

from dynarl.backends.vllm._client import VLLMClient
from dynarl.backends.vllm._weight_group import (
    GroupSpec,
    host_store,
    join_group,
    push_spec,
    send_tensors,
)
from dynarl.errors import BackendError
from dynarl.migrate import CommGroup

__all__ = ["PushReport", "WeightPusher"]

logger = logging.getLogger(__name__)

_names = itertools.count()


@dataclass(frozen=True, kw_only=True, slots=True)
class PushReport:
    """What one push did."""

    version: str
    num_tensors: int
    bytes_sent: int
    seconds: float
    """From pause to resume."""


class WeightPusher:
    """Rank 0 of a weight-push group over ``clients``' engines (one worker each: TP 1).

    ``async with WeightPusher(clients) as pusher: await pusher.push(tensors, "3")``.
    ``host`` is the address the engines reach this process at.
    """

    def __init__(
        self,
        clients: Sequence[VLLMClient],
        *,
        host: str = "127.0.0.1",
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        if not clients:
            raise ValueError("WeightPusher needs at least one engine client")
        self.clients = tuple(clients)
        self.host = host
        self.backend = backend
        self.timeout_s = timeout_s
        self._group: CommGroup | None = None

    async def __aenter__(self) -> WeightPusher:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Host the group and have every engine join it (BackendError if one cannot)."""
        store = host_store(self.host, self.timeout_s)
        name = f"dynarl/vllm-weights/{os.getpid()}/{next(_names)}"
        size = len(self.clients) + 1
        specs = [
            GroupSpec(
                name=name,
                host=self.host,
                port=store.port,
                rank=rank,
                world_size=size,
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
            for rank in range(size)
        ]
        joins = [
            asyncio.ensure_future(
                client.collective_rpc(
                    "dynarl_join_weight_group",
                    [msgspec.json.encode(spec).decode()],
                    timeout_s=self.timeout_s,
                )
            )
            for client, spec in zip(self.clients, specs[1:], strict=True)
        ]
        try:
            self._group = await asyncio.to_thread(join_group, specs[0], store)
            await asyncio.gather(*joins)
        except BaseException as exc:
            for join in joins:
                join.cancel()
            await asyncio.gather(*joins, return_exceptions=True)
            if isinstance(exc, Exception) and not isinstance(exc, BackendError):
                raise BackendError(f"weight group {name}: engines could not join: {exc}") from exc
            raise
        logger.info("weight group %s: %d engines joined", name, len(self.clients))

    async def aclose(self) -> None:
        """Have the engines leave the group, then leave it (idempotent)."""
        group, self._group = self._group, None
        if group is None:
            return
        await asyncio.gather(
            *(c.collective_rpc("dynarl_leave_weight_group") for c in self.clients),
            return_exceptions=True,
        )
        group.close()

    async def push(self, tensors: Mapping[str, torch.Tensor], version: str) -> PushReport:
        """Load ``tensors`` (HF names, the engines' dtype) into every engine and label
        later tokens ``version`` (see the module docstring). BackendError if an engine
        fails; the engines are resumed either way."""
        group = self._group
        if group is None:
            raise RuntimeError("WeightPusher.push before open()")
        if not tensors:
            raise ValueError("push needs at least one tensor")
        spec = msgspec.json.encode(push_spec(tensors)).decode()
        start = time.perf_counter()
        await asyncio.gather(*(c.pause("keep") for c in self.clients))
        try:
            loads = [
                asyncio.ensure_future(
                    c.collective_rpc("dynarl_receive_weights", [spec], timeout_s=self.timeout_s)
                )
                for c in self.clients
            ]
            sent = await asyncio.to_thread(send_tensors, group, tensors)
            await asyncio.gather(*loads)
            await asyncio.gather(
                *(c.reset_prefix_cache(reset_running_requests=True) for c in self.clients)
            )
            await asyncio.gather(*(c.update_weight_version(version) for c in self.clients))
        finally:
            await asyncio.gather(*(c.resume() for c in self.clients))
        seconds = time.perf_counter() - start
        logger.info("pushed %d tensors (version %s) in %.3f s", len(tensors), version, seconds)
        return PushReport(
            version=version, num_tensors=len(tensors), bytes_sent=sent, seconds=seconds
        )
