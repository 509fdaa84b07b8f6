"""The random states a checkpoint binds: Python's, NumPy's global, torch's CPU and CUDA.

:func:`capture_rng` reads them into an :class:`RngState` (a ``msgspec`` struct, stored in
the checkpoint manifest per rank) and :func:`restore_rng` puts them back, so a resumed
rank draws the same numbers the uninterrupted one would have. CUDA states are captured
only when CUDA is available, one per visible device. Runs on any rank, in its compute
thread (torch's generators are process-global).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgspec
import numpy as np
import torch

__all__ = ["RngState", "capture_rng", "load_rng_file", "restore_rng", "save_rng_file"]


class RngState(msgspec.Struct, frozen=True, kw_only=True):
    """The generators of one process."""

    python: tuple[int, ...]
    """``random.getstate()``'s internal state (version, then the Mersenne Twister words)."""
    python_gauss: float | None
    """``random.getstate()``'s cached Gaussian."""
    numpy_keys: tuple[int, ...]
    """``numpy.random.get_state()``'s MT19937 key."""
    numpy_pos: int
    """Its position."""
    numpy_gauss: tuple[int, float]
    """Its cached Gaussian (has_gauss, value)."""
    torch_cpu: bytes
    """``torch.get_rng_state()``."""
    torch_cuda: tuple[bytes, ...] = ()
    """``torch.cuda.get_rng_state_all()``; empty without CUDA."""


def capture_rng() -> RngState:
    """The current states of every generator of this process."""
    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert name == "MT19937"
    cuda: tuple[bytes, ...] = ()
    if torch.cuda.is_available():
        cuda = tuple(bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all())
    return RngState(
        python=(version, *words),
        python_gauss=gauss,
        numpy_keys=tuple(int(k) for k in keys),
        numpy_pos=int(pos),
        numpy_gauss=(int(has_gauss), float(cached)),
        torch_cpu=bytes(torch.get_rng_state().numpy().tobytes()),
        torch_cuda=cuda,
    )


def _byte_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def restore_rng(state: RngState) -> None:
    """Put every generator back to ``state``.

    Raises ValueError if ``state`` holds CUDA states but this process sees a different
    number of CUDA devices.
    """
    version, *words = state.python
    random.setstate((version, tuple(words), state.python_gauss))
    keys = np.array(state.numpy_keys, dtype=np.uint32)
    has_gauss, cached = state.numpy_gauss
    np.random.set_state(("MT19937", keys, state.numpy_pos, has_gauss, cached))
    torch.set_rng_state(_byte_tensor(state.torch_cpu))
    if state.torch_cuda:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count != len(state.torch_cuda):
            raise ValueError(
                f"checkpoint holds {len(state.torch_cuda)} CUDA RNG states; {count} devices here"
            )
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in state.torch_cuda])


def _rng_file(directory: str | os.PathLike[str], rank: int) -> Path:
    return Path(directory) / f"rng-{rank}.msgpack"


def save_rng_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """Write this process's generators to ``directory/rng-<rank>.msgpack`` (written
    aside, fsynced, renamed: what a worker adds to its role's checkpoint)."""
    path = _rng_file(directory, rank)
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("wb") as file:
        file.write(msgspec.msgpack.encode(capture_rng()))
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    return path


def load_rng_file(directory: str | os.PathLike[str], rank: int) -> bool:
    """Restore this process's generators from ``directory`` if it holds ``rank``'s file;
    whether it did. Raises msgspec.DecodeError for a damaged file."""
    path = _rng_file(directory, rank)
    if not path.exists():
        return False
    restore_rng(msgspec.msgpack.decode(path.read_bytes(), type=RngState))
    return True
