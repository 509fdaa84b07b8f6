"""What SGLang's ``/weights_checker`` reports, computed on the trainer's side.

SGLang 0.5.23 hashes every parameter of its *internal* model (``utils/weight_checker.py``):
Llama/Qwen-style models fuse ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into
``gate_up_proj`` and shard them per TP rank (``models/qwen2.py`` ``stacked_params_mapping``,
``layers/linear.py``, ``layers/vocab_parallel_embedding.py``). Each hash is
``f"{tensor_hash(param):016x}"`` where ``tensor_hash`` is a Triton kernel on CUDA
(``kernels/ops/memory/gpu_tensor_hash.py``) and SHA-256 on CPU (``managers/mm_utils.py``);
a rank's ``per_gpu_checksum`` is SHA-256 over the sorted (name, hash) pairs, and the
engine's ``per_engine_checksum`` SHA-256 over the ranks' ``per_gpu_checksum`` in order.

:func:`expected_checksums` rebuilds those figures from the full HF-named tensors the trainer
broadcast, so a weight sync can be proved to have landed bit for bit. The CUDA hash here
is a NumPy re-implementation of the kernel's arithmetic (all modular); it is checked
against the kernel only where a GPU and the wheel are present (``tests/gpu``).
Pure functions; run on any rank.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from dynarl.backends.sglang._http_wire import ChecksumReply

__all__ = [
    "ExpectedChecksums",
    "HashDevice",
    "checksum_mismatches",
    "cpu_tensor_hash",
    "cuda_tensor_hash",
    "engine_checksum",
    "expected_checksums",
    "overall_checksum",
    "sglang_rank_params",
    "tensor_hash_hex",
]

HashDevice = Literal["cuda", "cpu"]

_NON_PERSISTENT = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis")
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_FMIX_C1, _FMIX_C2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_POS_C1, _POS_C2 = np.uint32(0x27D4EB2D), np.uint32(0x165667B1)
_SEED = 0x243F6A88
_TILE_WORDS = 8192
_VOCAB_PADDING = 64


def cpu_tensor_hash(tensor: torch.Tensor) -> int:
    """SGLang's CPU ``tensor_hash``: the first 8 bytes of SHA-256 of the raw bytes."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.sha256(data.data).digest()[:8], "big")


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    rotated: np.ndarray = (x << np.uint32(r)) | (x >> np.uint32(32 - r))
    return rotated


def _fmix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * _FMIX_C1
    x = x ^ (x >> np.uint32(13))
    x = x * _FMIX_C2
    mixed: np.ndarray = x ^ (x >> np.uint32(16))
    return mixed


def _splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def cuda_tensor_hash(tensor: torch.Tensor) -> int:
    """SGLang's CUDA ``tensor_hash`` (``gpu_tensor_hash`` with its defaults), on the CPU.

    The bytes, zero-padded to 4, are read as little-endian uint32 words; each word is mixed
    with its index, summed per 8192-word tile (mod 2^32), finalised per tile into 64 bits,
    summed over tiles (mod 2^64) and passed through splitmix64. Sums are modular, so the
    kernel's reduction order does not matter.
    """
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    if data.size % 4:
        data = np.concatenate([data, np.zeros(4 - data.size % 4, dtype=np.uint8)])
    words = data.view("<u4").astype(np.uint32)
    n = words.size
    if n == 0:
        return 0
    index = np.arange(n, dtype=np.uint32)
    seed1 = np.uint32(_SEED & _M32)
    seed2 = np.uint32(((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32)
    k1 = _fmix32(words ^ ((index * _POS_C1 + seed1) ^ _rotl(index, 15)))
    k2 = _fmix32(words ^ ((index * _POS_C2 + seed2) ^ _rotl(index, 13)))
    num_tiles = -(-n // _TILE_WORDS)
    pad = num_tiles * _TILE_WORDS - n
    h1 = np.pad(k1, (0, pad)).reshape(num_tiles, _TILE_WORDS).sum(axis=1, dtype=np.uint32)
    h2 = np.pad(k2, (0, pad)).reshape(num_tiles, _TILE_WORDS).sum(axis=1, dtype=np.uint32)
    nbytes = np.uint32((n * 4) & _M32)
    h1, h2 = _fmix32(h1 ^ nbytes), _fmix32(h2 ^ nbytes)
    partials = (h1.astype(np.uint64) << np.uint64(32)) | h2.astype(np.uint64)
    return _splitmix64(int(partials.sum(dtype=np.uint64)))


def tensor_hash_hex(tensor: torch.Tensor, device: HashDevice = "cuda") -> str:
    """One parameter's entry in a ``/weights_checker`` ``checksums`` map."""
    value = cuda_tensor_hash(tensor) if device == "cuda" else cpu_tensor_hash(tensor)
    return f"{value:016x}"


def overall_checksum(checksums: Mapping[str, str]) -> str:
    """A rank's ``per_gpu_checksum``: SHA-256 over the sorted (name, hash) pairs."""
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    return digest.hexdigest()


def engine_checksum(per_gpu_checksums: Sequence[str]) -> str:
    """The engine's ``per_engine_checksum``: SHA-256 over the ranks' checksums in order."""
    digest = hashlib.sha256()
    for checksum in per_gpu_checksums:
        digest.update(checksum.encode())
    return digest.hexdigest()


_FUSED = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW_PARALLEL = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _vocab_shard(tensor: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    vocab = tensor.shape[0]
    padding = _VOCAB_PADDING
    if -(-vocab // padding) * padding % tp_size:
        padding *= tp_size
    per_rank = -(-vocab // padding) * padding // tp_size
    shard = torch.zeros((per_rank, *tensor.shape[1:]), dtype=tensor.dtype)
    rows = tensor[rank * per_rank : min((rank + 1) * per_rank, vocab)]
    shard[: rows.shape[0]] = rows
    return shard


def _column_shard(
    tensor: torch.Tensor, kind: str, rank: int, tp_size: int, num_kv_heads: int | None
) -> torch.Tensor:
    if kind in ("k_proj", "v_proj") and num_kv_heads is not None and num_kv_heads < tp_size:
        if tp_size % num_kv_heads:
            raise ValueError(f"tp_size {tp_size} is not a multiple of {num_kv_heads} KV heads")
        head = rank * num_kv_heads // tp_size
        return tensor.chunk(num_kv_heads, dim=0)[head]
    if tensor.shape[0] % tp_size:
        raise ValueError(f"{kind}: dim 0 ({tensor.shape[0]}) is not divisible by tp {tp_size}")
    return tensor.chunk(tp_size, dim=0)[rank]


def sglang_rank_params(
    hf_tensors: Mapping[str, torch.Tensor],
    *,
    tp_size: int = 1,
    num_key_value_heads: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """SGLang's internal parameters per TP rank, built from full HF-named tensors.

    Fuses ``q/k/v_proj`` → ``qkv_proj`` and ``gate/up_proj`` → ``gate_up_proj`` (rank-local
    shards concatenated), splits ``o_proj``/``down_proj`` along dim 1 and the vocabulary
    (padded to a multiple of 64 with zero rows) along dim 0, and replicates the rest.
    Non-persistent buffers (rotary caches) are dropped. Raises ValueError when a dimension
    does not divide by ``tp_size`` or KV heads must be replicated without
    ``num_key_value_heads``.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    order = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
    ranks: list[dict[str, torch.Tensor]] = []
    for rank in range(tp_size):
        params: dict[str, torch.Tensor] = {}
        fused: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for name, tensor in hf_tensors.items():
            if any(pattern in name for pattern in _NON_PERSISTENT):
                continue
            match = _FUSED.match(name)
            if match:
                prefix, kind, suffix = match.groups()
                target = "qkv_proj" if kind in ("q_proj", "k_proj", "v_proj") else "gate_up_proj"
                shard = _column_shard(tensor, kind, rank, tp_size, num_key_value_heads)
                fused.setdefault(f"{prefix}.{target}.{suffix}", []).append((order[kind], shard))
            elif name in _VOCAB:
                params[name] = _vocab_shard(tensor, rank, tp_size)
            elif _ROW_PARALLEL.search(name):
                if tensor.shape[1] % tp_size:
                    raise ValueError(f"{name}: dim 1 is not divisible by tp {tp_size}")
                params[name] = tensor.chunk(tp_size, dim=1)[rank]
            else:
                params[name] = tensor
        for name, parts in fused.items():
            params[name] = torch.cat([part for _, part in sorted(parts, key=lambda p: p[0])])
        ranks.append(params)
    return ranks


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpectedChecksums:
    """The ``/weights_checker`` figures an engine should report for some weights."""

    per_rank: tuple[dict[str, str], ...]
    """Per TP rank: parameter name → hash."""
    per_gpu: tuple[str, ...]
    """Per TP rank: ``per_gpu_checksum``."""
    per_engine: str
    """``per_engine_checksum``."""


def expected_checksums(
    hf_tensors: Mapping[str, torch.Tensor],
    *,
    tp_size: int = 1,
    num_key_value_heads: int | None = None,
    dtype: torch.dtype | None = None,
    device: HashDevice = "cuda",
    skip_tensor_list: Sequence[str] = (),
) -> ExpectedChecksums:
    """What an engine holding ``hf_tensors`` (cast to ``dtype``) reports; see the module doc."""
    cast = {n: (t.to(dtype) if dtype is not None else t) for n, t in hf_tensors.items()}
    shards = sglang_rank_params(cast, tp_size=tp_size, num_key_value_heads=num_key_value_heads)
    per_rank = [
        {
            name: tensor_hash_hex(tensor, device)
            for name, tensor in params.items()
            if not any(part in name for part in skip_tensor_list)
        }
        for params in shards
    ]
    per_gpu = tuple(overall_checksum(checksums) for checksums in per_rank)
    return ExpectedChecksums(
        per_rank=tuple(per_rank), per_gpu=per_gpu, per_engine=engine_checksum(per_gpu)
    )


def checksum_mismatches(reply: ChecksumReply, expected: ExpectedChecksums) -> list[str]:
    """Parameter names (``rank<r>:<name>``) whose reported hash differs; empty when equal.

    Raises ValueError if the reply failed or has a different number of ranks.
    """
    if not reply.success:
        raise ValueError(f"weights_checker failed: {reply.message}")
    if len(reply.ranks) != len(expected.per_rank):
        raise ValueError(f"reply has {len(reply.ranks)} ranks, expected {len(expected.per_rank)}")
    return [
        f"rank{rank}:{name}"
        for rank, (got, want) in enumerate(zip(reply.ranks, expected.per_rank, strict=True))
        for name in sorted(set(got.checksums) | set(want))
        if got.checksums.get(name) != want.get(name)
    ]
