"""Which trainer layouts a model takes, and the :class:`LayoutSpec` it takes them in.

The parallel sizes are the caller's; the rest follows from the model and the device:

- parameter and master dtypes come from the model (an fp32 master copy for half-precision
  parameters);
- a mixture-of-experts model with TP > 1 runs with sequence parallelism (Megatron's MoE
  layer refuses to train without it); a dense model only when asked;
- the distributed optimizer is Megatron's and needs CUDA;
- expert parallelism (``ep > 1``) runs on the CPU trainer only: on CUDA the expert
  parameters would need Megatron's second optimizer over DDP's expert buffers, which the
  trainer does not build.

Pure functions over configs; used by :class:`MegatronTrainer` and :class:`MegatronSetup`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dynarl.backends.megatron._train_config import GPTModelConfig
from dynarl.migrate import LayoutSpec

__all__ = ["check_layout_spec", "model_layout_spec"]


def model_layout_spec(
    model: GPTModelConfig,
    ranks: Sequence[int],
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    distributed_optimizer: bool = False,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    sequence_parallel: bool | None = None,
) -> LayoutSpec:
    """A :class:`LayoutSpec` over ``ranks`` with ``model``'s dtypes; ``sequence_parallel``
    None: on exactly when the model is MoE and ``tp > 1``. Raises ValueError for sizes
    LayoutSpec refuses."""
    dtype = model.params_dtype
    if sequence_parallel is None:
        sequence_parallel = model.is_moe and tp > 1
    return LayoutSpec(
        ranks=tuple(ranks),
        tp=tp,
        pp=pp,
        dp=dp,
        distributed_optimizer=distributed_optimizer,
        param_dtype=dtype,
        master_dtype=None if dtype == "float32" else "float32",
        expert_parallel=expert_parallel,
        expert_tensor_parallel=expert_tensor_parallel,
        sequence_parallel=sequence_parallel,
    )


def check_layout_spec(model: GPTModelConfig, spec: LayoutSpec, device: torch.device) -> None:
    """Raise ValueError, naming the field, when the trainer cannot build ``model`` under
    ``spec`` on ``device`` (see the module docstring)."""
    want = model_layout_spec(model, spec.ranks[:1])
    if (spec.param_dtype, spec.master_dtype) != (want.param_dtype, want.master_dtype):
        raise ValueError(
            f"layout dtypes ({spec.param_dtype}, master {spec.master_dtype}) differ from "
            f"the model's ({want.param_dtype}, master {want.master_dtype})"
        )
    if spec.distributed_optimizer and device.type != "cuda":
        raise ValueError("the distributed optimizer is Megatron's and needs CUDA")
    if model.is_moe and spec.tp > 1 and not spec.sequence_parallel:
        raise ValueError(
            "sequence_parallel: a MoE model with tp > 1 needs sequence_parallel=True "
            "(Megatron's MoE layer refuses to train without it)"
        )
    if spec.ep > 1 and device.type == "cuda":
        raise ValueError(
            "expert_parallel > 1 runs on the CPU trainer only (Megatron's optimizer for "
            "expert-parallel parameters is not built on CUDA)"
        )
