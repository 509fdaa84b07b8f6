"""The fake engine's weights, weight-update groups and weight endpoints.

Weights are kept as full HF-named tensors; ``/weights_checker`` reports them in SGLang's
internal layout (fused ``qkv_proj``/``gate_up_proj``, TP shards) through the same
:func:`~dynarl.backends.sglang.sglang_rank_params` the trainer uses for its
expectation, so the fake can only confirm that the bytes the trainer broadcast arrived —
the layout itself is checked against a real server (contract tests with
``DYNARL_SGLANG_URL``). A weight-update group is a real torch.distributed group joined as
SGLang joins it (gloo here), so a trainer broadcasts to the fake for real.
Runs on the fake server's event loop; blocking torch.distributed calls run in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import torch
from aiohttp import web
from torch.distributed import ProcessGroup

from dynarl.backends.sglang import (
    Bucket,
    HashDevice,
    TensorMeta,
    close_update_group,
    dtype_from_name,
    engine_checksum,
    open_update_group,
    overall_checksum,
    receive_bucket,
    receive_tensor,
    sglang_rank_params,
    tensor_hash_hex,
)
from dynarl.testing.sglang_fake import _schema as schema
from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._replies import json_reply, validation_error
from dynarl.testing.sglang_fake._scheduler import FakeScheduler

__all__ = ["FakeModel", "UpdateGroups", "WeightEndpoints"]

logger = logging.getLogger(__name__)

_NOT_FLUSHED_AFTER_UPDATE = (
    "Weights were updated, but the cache was not flushed because requests are still "
    "running or queued. Retract or finish them, then call /flush_cache."
)


class FakeModel:
    """Full HF-named weights; loads received tensors and reports SGLang's checksums."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        tp_size: int,
        hash_device: HashDevice,
        num_key_value_heads: int | None = None,
    ) -> None:
        self.weights = {name: tensor.detach().clone() for name, tensor in weights.items()}
        self.tp_size = tp_size
        self.hash_device = hash_device
        self.num_key_value_heads = num_key_value_heads

    @property
    def nbytes(self) -> int:
        """Bytes of all weights."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def load(self, named: list[tuple[str, torch.Tensor]]) -> tuple[bool, str]:
        """Copy received tensors into the weights (cast to each weight's dtype).

        Like SGLang's ``load_weights_from_distributed``, a bad name or shape fails the call
        and leaves earlier tensors of the call loaded.
        """
        for name, tensor in named:
            target = self.weights.get(name)
            if target is None or target.shape != tensor.shape:
                problem = repr(name) if target is None else f"shape mismatch for {name}"
                return False, (
                    f"Failed to update parameter online: {problem}. The full weights of the "
                    "ModelRunner are partially updated. Please discard the whole weights."
                )
            target.copy_(tensor)
        return True, "Succeeded to update parameter online."

    def zero(self) -> None:
        """Released weights without CPU backup come back undefined; zeros here."""
        for tensor in self.weights.values():
            tensor.zero_()

    def checksum_reply(self, skip_tensor_list: list[str] | None) -> dict[str, Any]:
        """The ``/weights_checker`` body for ``action="checksum"``."""
        ranks: list[dict[str, Any]] = []
        shards = sglang_rank_params(
            self.weights, tp_size=self.tp_size, num_key_value_heads=self.num_key_value_heads
        )
        for rank, params in enumerate(shards):
            checksums = {
                name: tensor_hash_hex(tensor, self.hash_device)
                for name, tensor in params.items()
                if not any(part in name for part in skip_tensor_list or ())
            }
            info = {
                "role": "target",
                "tp_rank": rank,
                "tp_size": self.tp_size,
                "dp_rank": 0,
                "dp_size": 1,
                "pp_rank": 0,
                "pp_size": 1,
                "rank": rank,
                "size": self.tp_size,
            }
            ranks.append(
                {
                    "checksums": checksums,
                    "per_gpu_checksum": overall_checksum(checksums),
                    "parallelism_info": [info],
                }
            )
        return {
            "success": True,
            "message": "Success.",
            "ranks": ranks,
            "per_engine_checksum": engine_checksum([str(r["per_gpu_checksum"]) for r in ranks]),
        }


def _alignment_error(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> str | None:
    offset = 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype = dtype_from_name(dtype_name)
        if any(dim < 0 for dim in shape):
            return f"Negative dimension in received tensor {name}: {torch.Size(shape)}"
        if offset % dtype.itemsize:
            return f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}"
        offset += torch.Size(shape).numel() * dtype.itemsize
    return None


class UpdateGroups:
    """The weight-update process groups this fake engine joined, by name."""

    def __init__(self, *, tp_size: int, timeout_s: float) -> None:
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self.groups: dict[str, ProcessGroup] = {}
        self.devices: dict[str, str] = {}
        """Where each group's broadcasts land: ``cuda`` (this process's current GPU) for an
        NCCL group, else ``cpu``; the model takes them on the CPU either way."""

    async def join(self, body: Any) -> tuple[bool, str]:
        """``/init_weights_update_group``: blocks until every member joined."""
        if self.tp_size != 1:
            return False, "FakeSGLangServer joins weight-update groups only with tp_size=1"
        try:
            group = await asyncio.to_thread(
                open_update_group,
                master_address=body.master_address,
                master_port=body.master_port,
                rank=body.rank_offset,
                world_size=body.world_size,
                group_name=body.group_name,
                backend=body.backend,
                timeout_s=self.timeout_s,
            )
        except Exception as exc:  # SGLang reports any failure in the message
            message = f"Failed to initialize custom process group: {exc}."
            logger.error(message)
            return False, message
        self.groups[body.group_name] = group
        self.devices[body.group_name] = "cuda" if body.backend == "nccl" else "cpu"
        return True, "Succeeded to initialize custom process group."

    async def leave(self, group_name: str) -> tuple[bool, str]:
        """``/destroy_weights_update_group``."""
        group = self.groups.pop(group_name, None)
        self.devices.pop(group_name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        await asyncio.to_thread(close_update_group, group)
        return True, "Succeeded to destroy custom process group."

    async def receive(self, body: Any) -> list[tuple[str, torch.Tensor]]:
        """Receive one update's tensors; raises (→ ``Failed to receive weights: ...``)."""
        if body.group_name not in self.groups:
            raise AssertionError(
                f"Group {body.group_name} not in {list(self.groups)}. "
                "Please call `init_weights_update_group` first."
            )
        group, device = self.groups[body.group_name], self.devices[body.group_name]
        if body.load_format == "flattened_bucket":
            error = _alignment_error(body.names, body.dtypes, body.shapes)
            if error is not None:
                raise ValueError(error)
            metas = tuple(
                TensorMeta(name=n, dtype=d, shape=tuple(s))
                for n, d, s in zip(body.names, body.dtypes, body.shapes, strict=True)
            )
            bucket = await receive_bucket(group, Bucket(tensors=metas), self.timeout_s, device)
            return [(name, tensor.cpu()) for name, tensor in bucket]
        received = []
        for name, dtype, shape in zip(body.names, body.dtypes, body.shapes, strict=True):
            meta = TensorMeta(name=name, dtype=dtype, shape=tuple(shape))
            tensor = await receive_tensor(group, meta, self.timeout_s, device)
            received.append((name, tensor.cpu()))
        return received

    async def aclose(self) -> None:
        """Destroy every group still joined."""
        for name in list(self.groups):
            await self.leave(name)


async def _body(request: web.Request, kind: type[schema.Body]) -> schema.Body:
    return schema.decode_body(await request.read(), kind)


class WeightEndpoints:
    """Weight-update groups, the begin/end session and ``/weights_checker``.

    Updates hold the tokenizer's writer lock (they wait for in-flight requests and hold new
    ones back) unless generation is paused, as ``tokenizer_control_mixin.py`` does.
    """

    def __init__(
        self,
        config: FakeSGLangConfig,
        model: FakeModel,
        scheduler: Callable[[], FakeScheduler],
    ) -> None:
        self.config = config
        self.model = model
        self._scheduler = scheduler
        self._groups = UpdateGroups(tp_size=config.tp_size, timeout_s=config.group_timeout_s)
        self._session: dict[str, Any] | None = None

    @property
    def scheduler(self) -> FakeScheduler:
        """The running server's scheduler."""
        return self._scheduler()

    async def aclose(self) -> None:
        """Leave every weight-update group."""
        await self._groups.aclose()

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request, schema.InitWeightsUpdateGroupReqInput)
        except ValueError as exc:
            return validation_error(str(exc))
        success, message = await self._groups.join(body)
        return json_reply({"success": success, "message": message}, 200 if success else 400)

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request, schema.DestroyWeightsUpdateGroupReqInput)
        except ValueError as exc:
            return validation_error(str(exc))
        success, message = await self._groups.leave(body.group_name)
        return json_reply({"success": success, "message": message}, 200 if success else 400)

    @contextlib.asynccontextmanager
    async def _writer_lock(self) -> AsyncIterator[None]:
        """The tokenizer's ``model_update_lock.writer_lock``, unless generation is paused."""
        scheduler = self.scheduler
        if scheduler.frontend_paused:
            yield
            return
        scheduler.updating = True
        try:
            await scheduler.wait_drained()
            yield
        finally:
            scheduler.updating = False
            await scheduler.notify()

    async def begin_update(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request, schema.BeginWeightUpdateReqInput)
        except ValueError as exc:
            return validation_error(str(exc))
        async with self._writer_lock():
            if self._session is not None:
                success, message = (
                    False,
                    ("a weight-update session is already open; call end_weight_update() first"),
                )
            else:
                self._session = {"selector": body.selector, "loaded": False}
                success, message = True, "Success"
        return json_reply({"success": success, "message": message}, 200 if success else 400)

    async def end_update(self, request: web.Request) -> web.Response:
        try:
            await _body(request, schema.EndWeightUpdateReqInput)
        except ValueError as exc:
            return validation_error(str(exc))
        async with self._writer_lock():
            if self._session is None:
                success, message = (
                    False,
                    ("no weight-update session is open; call begin_weight_update() first"),
                )
            else:
                self._session = None
                success, message = True, "Success"
        return json_reply({"success": success, "message": message}, 200 if success else 400)

    async def update_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request, schema.UpdateWeightsFromDistributedReqInput)
        except ValueError as exc:
            return validation_error(str(exc))
        if body.abort_all_requests:
            self.scheduler.abort("", abort_all=True)
        async with self._writer_lock():
            success, message = await self._receive_and_load(body)
        if success and body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return json_reply({"success": success, "message": message}, 200 if success else 400)

    async def _receive_and_load(
        self, body: schema.UpdateWeightsFromDistributedReqInput
    ) -> tuple[bool, str]:
        if self._session is None:
            return False, (
                "update_weights_from_distributed must run between "
                "begin_weight_update() and end_weight_update()"
            )
        try:
            received = await self._groups.receive(body)
        except Exception as exc:  # SGLang reports any receive failure in the message
            return False, f"Failed to receive weights: {exc}"
        success, message = self.model.load(received)
        if not success:
            return success, message
        self._session["loaded"] = True
        self.scheduler.set_weight_version(body.weight_version)
        if body.flush_cache and not self.scheduler.flush():
            return False, _NOT_FLUSHED_AFTER_UPDATE
        return True, message

    async def weights_checker(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = (
                schema.decode_body(raw, schema.CheckWeightsReqInput)
                if raw.strip()
                else schema.CheckWeightsReqInput()
            )
        except ValueError as exc:
            return validation_error(str(exc))
        if body.action != "checksum":
            message = f"FakeSGLangServer models only action='checksum', not {body.action!r}"
            return json_reply({"success": False, "message": message}, 400)
        reply = await asyncio.to_thread(self.model.checksum_reply, body.skip_tensor_list)
        return json_reply(reply)
