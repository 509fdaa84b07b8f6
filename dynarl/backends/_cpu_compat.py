"""Megatron-core on CPU-only torch: the one place where ``torch.cuda`` is redirected.

Megatron-core 0.16.1 calls a handful of ``torch.cuda`` functions unconditionally
(``current_device`` in rotary embeddings and the global memory buffer, ``synchronize`` in
``dist_checkpointing``, the CUDA RNG tracker). On a machine without CUDA they raise
"Torch not compiled with CUDA enabled". :func:`apply_cpu_shim` points exactly those entry
points at CPU equivalents, and only when CUDA is absent; on a CUDA machine it does nothing,
so GPU runs use Megatron unmodified. The Megatron optimizer needs CUDA regardless (it
allocates with a literal ``device='cuda'``): trainers on CPU own the step with
``torch.optim`` on ``param.main_grad``.

Callers must also pass an explicit attention mask: Megatron's default causal mask
(``transformer/utils.py:get_default_causal_mask``) is built with ``device="cuda"``.

Runs in whichever process imports Megatron; call it before the first Megatron import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["apply_cpu_shim", "cpu_shim_applied"]

logger = logging.getLogger(__name__)

_applied = False


# Each replacement is a distinct function: torch._dynamo keeps one tracing rule per
# function object, and two torch entry points sharing one object make it fail on startup.
def _synchronize(device: Any = None) -> None:
    return None


def _current_device() -> str:
    return "cpu"


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    return None


def _replacements() -> list[tuple[Any, str, Callable[..., Any]]]:
    return [
        (torch.cuda, "synchronize", _synchronize),
        (torch.cuda, "current_device", _current_device),
        (torch.cuda, "get_rng_state", _get_rng_state),
        (torch.cuda.random, "get_rng_state", _get_rng_state),
        (torch.cuda, "set_rng_state", _set_rng_state),
        (torch.cuda, "manual_seed", _manual_seed),
    ]


def apply_cpu_shim() -> bool:
    """Redirect Megatron's ``torch.cuda`` entry points to CPU when CUDA is absent.

    Returns True when the shim is (now or already) in force, False when CUDA is available
    and nothing was changed. Idempotent; process-wide.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        for owner, name, replacement in _replacements():
            setattr(owner, name, replacement)
        _applied = True
        logger.info("megatron CPU shim applied: torch.cuda entry points redirected to CPU")
    return True


def cpu_shim_applied() -> bool:
    """Whether :func:`apply_cpu_shim` has redirected ``torch.cuda`` in this process."""
    return _applied
