"""Shard files: one rank's tensors as raw bytes, checksummed, written atomically.

A shard file is the concatenation of its tensors' bytes (C order, CPU, each at a 64-byte
aligned offset); its index is a :class:`ShardRecord` (name, dtype, shape, offset, CRC-32 of
every tensor, plus the rank's RNG states) that the checkpoint manifest holds. Files are
written under a temporary name, fsynced and renamed, and their directory fsynced. Reads
verify every tensor they return. Nothing is pickled. Runs on the rank that owns the data.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec
import torch

from dynarl.errors import IntegrityError
from dynarl.runtime.durable._rng import RngState

__all__ = [
    "ShardRecord",
    "TensorEntry",
    "fsync_dir",
    "read_tensors",
    "write_atomic",
    "write_shard_file",
]

_ALIGN = 64


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True):
    """Where one tensor lies in its shard file."""

    name: str
    """Tensor name (a ``dynarl.migrate`` tensor name when the checkpoint has a layout)."""
    dtype: str
    """torch dtype name (``float32``, ``bfloat16``...)."""
    shape: tuple[int, ...]
    """Local shape."""
    offset: int
    """Byte offset in the file."""
    nbytes: int
    """Byte length."""
    crc32: int
    """CRC-32 of its bytes."""


class ShardRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's part of a checkpoint (sent by the rank to the controller)."""

    rank: int
    """Rank that wrote it."""
    file: str
    """File name inside the checkpoint directory."""
    nbytes: int
    """File size."""
    tensors: tuple[TensorEntry, ...]
    """Its tensors."""
    rng: RngState | None = None
    """The rank's RNG states, if captured."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; IntegrityError if there is none."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise IntegrityError(f"unknown dtype {name!r} in a checkpoint")
    return dtype


def _raw(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """Write ``chunks`` to ``path`` all or nothing: temporary file, fsync, rename, fsync."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with temp.open("wb") as file:
        for chunk in chunks:
            file.write(chunk)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp, path)
    fsync_dir(path.parent)


def write_shard_file(
    path: Path, rank: int, tensors: Mapping[str, torch.Tensor], *, rng: RngState | None = None
) -> ShardRecord:
    """Write ``tensors`` to ``path`` atomically; returns their index."""
    entries: list[TensorEntry] = []
    chunks: list[bytes | memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        raw = _raw(tensor)
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append(
            TensorEntry(
                name=name, dtype=dtype, shape=tuple(tensor.shape), offset=offset,
                nbytes=raw.nbytes, crc32=zlib.crc32(raw),
            )
        )  # fmt: skip
        pad = -raw.nbytes % _ALIGN
        chunks += [raw, bytes(pad)]
        offset += raw.nbytes + pad
    write_atomic(path, chunks)
    return ShardRecord(rank=rank, file=path.name, nbytes=offset, tensors=tuple(entries), rng=rng)


def read_tensors(
    path: Path, shard: ShardRecord, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of ``shard`` (or only ``names``) from its file ``path``, verified.

    Raises IntegrityError on a CRC mismatch or a short file, ValueError for a name the
    shard does not hold.
    """
    entries = {e.name: e for e in shard.tensors}
    wanted = list(entries) if names is None else list(names)
    out: dict[str, torch.Tensor] = {}
    with path.open("rb") as file:
        for name in wanted:
            entry = entries.get(name)
            if entry is None:
                raise ValueError(f"shard of rank {shard.rank} holds no tensor {name!r}")
            data = bytearray(os.pread(file.fileno(), entry.nbytes, entry.offset))
            if len(data) != entry.nbytes or zlib.crc32(data) != entry.crc32:
                raise IntegrityError(f"{path}: tensor {name!r} fails its checksum")
            dtype = torch_dtype(entry.dtype)
            if entry.nbytes == 0:
                out[name] = torch.empty(entry.shape, dtype=dtype)
            else:
                raw = torch.frombuffer(data, dtype=torch.uint8)
                out[name] = raw.view(dtype).reshape(entry.shape)
    return out
