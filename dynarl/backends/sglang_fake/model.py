"""The fake engine's weights and weight-update groups.

Weights are kept as full HF-named tensors; ``/weights_checker`` reports them in SGLang's
internal layout (fused ``qkv_proj``/``gate_up_proj``, TP shards) through the same
:func:`~dynarl.backends.sglang.weight_check.sglang_rank_params` the trainer uses for its
expectation, so the fake can only confirm that the bytes the trainer broadcast arrived —
the layout itself is checked against a real server (contract tests with
``DYNARL_SGLANG_URL``). A weight-update group is a real torch.distributed group joined as
SGLang joins it (gloo here), so a trainer broadcasts to the fake for real.
Runs on the fake server's event loop; blocking torch.distributed calls run in threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from dynarl.backends.sglang.buckets import Bucket, TensorMeta, dtype_from_name
from dynarl.backends.sglang.weight_check import (
    HashDevice,
    engine_checksum,
    overall_checksum,
    sglang_rank_params,
    tensor_hash_hex,
)
from dynarl.backends.sglang.weight_sync import (
    close_update_group,
    open_update_group,
    receive_bucket,
    receive_tensor,
)

__all__ = ["FakeModel", "UpdateGroups"]

logger = logging.getLogger(__name__)


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
        return True, "Succeeded to initialize custom process group."

    async def leave(self, group_name: str) -> tuple[bool, str]:
        """``/destroy_weights_update_group``."""
        group = self.groups.pop(group_name, None)
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
        group = self.groups[body.group_name]
        if body.load_format == "flattened_bucket":
            error = _alignment_error(body.names, body.dtypes, body.shapes)
            if error is not None:
                raise ValueError(error)
            metas = tuple(
                TensorMeta(name=n, dtype=d, shape=tuple(s))
                for n, d, s in zip(body.names, body.dtypes, body.shapes, strict=True)
            )
            return await receive_bucket(group, Bucket(tensors=metas), self.timeout_s)
        received = []
        for name, dtype, shape in zip(body.names, body.dtypes, body.shapes, strict=True):
            meta = TensorMeta(name=name, dtype=dtype, shape=tuple(shape))
            received.append((name, await receive_tensor(group, meta, self.timeout_s)))
        return received

    async def aclose(self) -> None:
        """Destroy every group still joined."""
        for name in list(self.groups):
            await self.leave(name)
