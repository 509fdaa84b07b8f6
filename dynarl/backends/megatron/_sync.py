"""Weight sync MegatronTrainer → SGLang and vLLM engines, and the Megatron ↔ HF tensor map
they use.

SGLang takes full tensors under HF names, broadcast from one rank
(``/update_weights_from_distributed``). So:

1. :meth:`MegatronTrainer.gather` moves every parameter shard to the broadcasting rank
   (plan: :func:`dynarl.migrate.plan_reshard` with one full copy on that rank as the
   destination; TP shards, PP stages and DP replicas alike; checksummed);
2. :func:`to_hf` renames and re-lays them with
   :mod:`dynarl.backends.hf_layout` (fused QKV split per query group, gated
   ``linear_fc1`` into ``gate``/``up``) and, for a MoE model, :mod:`.hf_moe` (router and
   routed experts under Qwen-MoE names);
3. :func:`dynarl.backends.sglang.push_weights` buckets and broadcasts them inside
   ``/begin_weight_update`` … ``/end_weight_update``;
4. every engine's ``/weights_checker`` checksums are compared with the ones computed from
   the very tensors broadcast (:func:`dynarl.backends.sglang.expected_checksums`).

:func:`sync_weights` runs all of it: the gather on every rank of the trainer layout (in a
worker thread), the rest on the broadcasting rank's event loop. :func:`sync_weights_vllm`
does steps 1 and 2 the same way and hands the HF tensors to a
:class:`~dynarl.backends.vllm.WeightPusher` (vLLM's engines load them through dynarl's
worker extension; the pushed version labels every later token). The same :func:`to_hf` /
:func:`from_hf` serve HF checkpoint directories (:mod:`.checkpoint`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from dynarl.backends.hf_layout import hf_to_megatron, megatron_to_hf
from dynarl.backends.megatron._hf_moe import is_moe_hf_name, is_moe_name, moe_from_hf, moe_to_hf
from dynarl.backends.megatron._megatron_trainer import MegatronTrainer
from dynarl.backends.megatron._train_config import GPTModelConfig
from dynarl.backends.sglang import (
    ClientConfig,
    ExpectedChecksums,
    HashDevice,
    SGLangClient,
    WeightSyncConfig,
    checksum_mismatches,
    expected_checksums,
    plan_weight_sync,
    push_weights,
)
from dynarl.backends.vllm import PushReport, VLLMClient, VLLMClientConfig, WeightPusher
from dynarl.errors import BackendError

__all__ = [
    "EngineTarget",
    "SyncReport",
    "check_hf_compatible",
    "from_hf",
    "hf_names",
    "push_to_engines",
    "sync_weights",
    "sync_weights_vllm",
    "to_hf",
]

logger = logging.getLogger(__name__)


def check_hf_compatible(model: GPTModelConfig) -> None:
    """Raise ValueError unless ``model`` maps onto an HF Llama/Qwen2 checkpoint (RMSNorm,
    SwiGLU, biases at most on the query/key/value projection)."""
    if model.normalization != "RMSNorm" or not model.gated_mlp or model.add_bias_linear:
        raise ValueError(
            "HF Llama/Qwen2 names need normalization='RMSNorm', gated_mlp=True and "
            "add_bias_linear=False"
        )


def to_hf(tensors: Mapping[str, torch.Tensor], model: GPTModelConfig) -> dict[str, torch.Tensor]:
    """Full Megatron-named tensors (as :meth:`MegatronTrainer.gather` returns them) → HF
    names and layouts (views where possible); a MoE model's routers and experts under
    Qwen-MoE names (:mod:`.hf_moe`). Raises ValueError for an incompatible model or an
    unknown name (a router or expert name of a dense model among them)."""
    check_hf_compatible(model)
    moe = {n: t for n, t in tensors.items() if model.is_moe and is_moe_name(n)}
    dense = {n: t for n, t in tensors.items() if n not in moe}
    return megatron_to_hf(dense, model.hf_layout()) | moe_to_hf(moe)


def from_hf(tensors: Mapping[str, torch.Tensor], model: GPTModelConfig) -> dict[str, torch.Tensor]:
    """HF-named tensors → full Megatron-named tensors (inverse of :func:`to_hf`)."""
    check_hf_compatible(model)
    moe = {n: t for n, t in tensors.items() if model.is_moe and is_moe_hf_name(n)}
    dense = {n: t for n, t in tensors.items() if n not in moe}
    return hf_to_megatron(dense, model.hf_layout()) | moe_from_hf(moe)


def hf_names(trainer: MegatronTrainer, megatron_names: Sequence[str]) -> dict[str, list[str]]:
    """For each Megatron parameter name, the HF names its tensor becomes (computed on
    ``meta`` tensors: no data)."""
    shapes = {spec.name: spec.shape for spec in trainer.specs}
    out = {}
    for name in megatron_names:
        meta = torch.empty(shapes[name], device="meta")
        out[name] = list(to_hf({name: meta}, trainer.model_config))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncReport:
    """What one weight sync did (on the broadcasting rank)."""

    num_tensors: int
    """HF tensors broadcast."""
    num_bytes: int
    """Bytes broadcast per engine."""
    num_buckets: int
    """Broadcasts (one ``update_weights_from_distributed`` each)."""
    gather_s: float
    """Seconds gathering the shards onto the broadcasting rank."""
    push_s: float
    """Seconds from group init to group destroyed."""
    verify_s: float
    """Seconds fetching and comparing ``/weights_checker`` checksums after the push (the
    expected ones are computed during it)."""
    per_engine_checksums: tuple[str, ...]
    """Each engine's ``per_engine_checksum`` after the sync (equal to the expected ones)."""


async def sync_weights(
    trainer: MegatronTrainer,
    clients: Sequence[SGLangClient],
    config: WeightSyncConfig,
    *,
    engine_tp_sizes: Sequence[int] | None = None,
    root: int | None = None,
    dtype: torch.dtype | None = None,
    checksum_device: HashDevice = "cuda",
) -> SyncReport | None:
    """Push the trainer's current weights to ``clients``' engines and prove they landed.

    Every rank of the trainer layout calls it (the gather is collective); ``clients`` are
    used on ``root`` (default: the layout's first rank), which returns the report; other
    ranks return None. ``dtype`` casts before broadcasting (the engine's dtype, e.g.
    bfloat16); ``checksum_device`` is the hash the engines use (``cuda`` on GPU servers).
    Pause or drain the engines first. Raises BackendError when an engine refuses a step
    or reports checksums that differ from the broadcast tensors', ValueError for an
    incompatible model.
    """
    layout = trainer.layout
    if layout is None:
        raise BackendError(f"rank {trainer.rank} holds no part of the trainer")
    root = layout.ranks[0] if root is None else root
    check_hf_compatible(trainer.model_config)
    began = time.perf_counter()
    full = await asyncio.to_thread(trainer.gather, root)
    gather_s = time.perf_counter() - began
    if trainer.rank != root:
        return None
    # Gloo broadcasts host memory; NCCL device memory (push_weights moves each bucket).
    device = "cpu" if config.backend == "gloo" else None
    hf = {
        name: t.to(device=device, dtype=dtype).contiguous()
        for name, t in to_hf(full, trainer.model_config).items()
    }
    tp_sizes = list(engine_tp_sizes) if engine_tp_sizes is not None else [1] * len(clients)
    plan = plan_weight_sync(hf, engine_tp_sizes=tp_sizes, max_bucket_bytes=config.max_bucket_bytes)

    async def push() -> float:
        began = time.perf_counter()
        await push_weights(clients, hf, plan, config)
        return time.perf_counter() - began

    # The expected checksums depend only on the tensors: hash them while they travel. Both
    # run to completion; a failed push is raised first (hashing cannot be interrupted).
    pushed, expected = await asyncio.gather(
        push(),
        asyncio.to_thread(_expected, hf, tp_sizes, trainer.model_config, checksum_device),
        return_exceptions=True,
    )
    for outcome in (pushed, expected):
        if isinstance(outcome, BaseException):
            raise outcome
    assert isinstance(pushed, float) and isinstance(expected, list)
    began = time.perf_counter()
    checksums = await _verify(clients, expected)
    report = SyncReport(
        num_tensors=len(hf),
        num_bytes=sum(t.numel() * t.element_size() for t in hf.values()),
        num_buckets=len(plan.buckets),
        gather_s=gather_s,
        push_s=pushed,
        verify_s=time.perf_counter() - began,
        per_engine_checksums=checksums,
    )
    logger.info(
        "weight sync: %d tensors, %d bytes, %d buckets to %d engines, verified",
        report.num_tensors,
        report.num_bytes,
        report.num_buckets,
        len(clients),
    )
    return report


async def sync_weights_vllm(
    trainer: MegatronTrainer,
    pusher: WeightPusher | None,
    version: str,
    *,
    root: int | None = None,
    dtype: torch.dtype | None = None,
) -> PushReport | None:
    """Push the trainer's current weights into ``pusher``'s vLLM engines as ``version``.

    Every rank of the trainer layout calls it (the gather is collective); ``pusher`` (open;
    None off ``root``) is used on ``root`` (default: the layout's first rank), which returns
    its report; other ranks return None. ``dtype`` casts first (the engines' dtype). The
    pusher pauses the engines in place for the load, drops their prefix cache and resumes
    them. Raises
    BackendError when the rank holds no part of the trainer or an engine fails, ValueError
    for a model that has no HF names.
    """
    layout = trainer.layout
    if layout is None:
        raise BackendError(f"rank {trainer.rank} holds no part of the trainer")
    root = layout.ranks[0] if root is None else root
    check_hf_compatible(trainer.model_config)
    if trainer.rank == root and pusher is None:
        raise ValueError("sync_weights_vllm: the pushing rank needs an open WeightPusher")
    full = await asyncio.to_thread(trainer.gather, root)
    if trainer.rank != root:
        return None
    assert pusher is not None
    hf = {
        name: t.to(device="cpu", dtype=dtype).contiguous()
        for name, t in to_hf(full, trainer.model_config).items()
    }
    report = await pusher.push(hf, version)
    logger.info("weight sync to vLLM: %d tensors as version %s", len(hf), version)
    return report


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """One engine a trainer pushes to: its kind and its server's root URL (what a serving
    role's ``engine_address`` call answers), and its tensor-parallel size (SGLang)."""

    kind: Literal["vllm", "sglang"]
    url: str
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("vllm", "sglang"):
            raise ValueError(f"EngineTarget.kind must be 'vllm' or 'sglang', got {self.kind!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"EngineTarget.url must be an http(s) URL, got {self.url!r}")
        if self.tp_size < 1:
            raise ValueError(f"EngineTarget.tp_size must be >= 1, got {self.tp_size}")


async def push_to_engines(
    trainer: MegatronTrainer,
    targets: Sequence[EngineTarget],
    version: str,
    *,
    root: int | None = None,
    dtype: torch.dtype | None = None,
    host: str = "127.0.0.1",
    backend: str = "gloo",
    checksum_device: HashDevice = "cuda",
) -> None:
    """Push the trainer's current weights to every target as ``version``: vLLM engines
    through a :class:`~dynarl.backends.vllm.WeightPusher` (:func:`sync_weights_vllm`),
    SGLang engines by their update-from-distributed sequence with the checksums verified
    (:func:`sync_weights`). Every rank of the trainer layout calls it with the same
    targets; ``root`` (default: the layout's first rank) hosts the groups on ``host``
    (an address the engines reach; ``backend`` ``nccl`` on GPU). Raises BackendError when
    an engine refuses or its weights differ afterwards.
    """
    layout = trainer.layout
    if layout is None:
        raise BackendError(f"rank {trainer.rank} holds no part of the trainer")
    root = layout.ranks[0] if root is None else root
    pushing = trainer.rank == root
    vllm = [target.url for target in targets if target.kind == "vllm"]
    sglang = [target for target in targets if target.kind == "sglang"]
    if vllm:
        clients = [VLLMClient(VLLMClientConfig(base_url=url)) for url in vllm] if pushing else []
        try:
            if pushing:
                async with WeightPusher(clients, host=host, backend=backend) as pusher:
                    await sync_weights_vllm(trainer, pusher, version, root=root, dtype=dtype)
            else:
                await sync_weights_vllm(trainer, None, version, root=root, dtype=dtype)
        finally:
            await asyncio.gather(*(client.aclose() for client in clients))
    if sglang:
        config = WeightSyncConfig(
            master_address=host,
            master_port=_free_port(host) if pushing else 1,  # used on the pushing rank only
            backend=backend,
            weight_version=version,
        )
        sglang_clients = [
            SGLangClient(ClientConfig(base_url=target.url)) for target in sglang if pushing
        ]
        try:
            await sync_weights(
                trainer,
                sglang_clients,
                config,
                engine_tp_sizes=[target.tp_size for target in sglang],
                root=root,
                dtype=dtype,
                checksum_device=checksum_device,
            )
        finally:
            await asyncio.gather(*(client.aclose() for client in sglang_clients))


def _free_port(host: str) -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _expected(
    hf: Mapping[str, torch.Tensor],
    tp_sizes: Sequence[int],
    model: GPTModelConfig,
    device: HashDevice,
) -> list[ExpectedChecksums]:
    """What each engine's ``/weights_checker`` must report (one computation per TP size)."""
    by_tp = {
        tp: expected_checksums(
            hf, tp_size=tp, num_key_value_heads=model.query_groups, device=device
        )
        for tp in sorted(set(tp_sizes))
    }
    return [by_tp[tp] for tp in tp_sizes]


async def _verify(
    clients: Sequence[SGLangClient], expected: Sequence[ExpectedChecksums]
) -> tuple[str, ...]:
    replies = await asyncio.gather(*(client.weights_checksum() for client in clients))
    out = []
    for index, (reply, want) in enumerate(zip(replies, expected, strict=True)):
        bad = checksum_mismatches(reply, want)
        if bad or reply.per_engine_checksum != want.per_engine:
            raise BackendError(f"engine {index}: weights differ after the sync in {bad[:5]}")
        out.append(want.per_engine)
    return tuple(out)
