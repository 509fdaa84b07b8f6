"""The trainer's optimizer and its state under layout names, on CPU and on GPU.

Both hold AdamW with Megatron's parameter groups (no weight decay on biases and 1-D
parameters) and expose the optimizer state as :mod:`dynarl.migrate` layouts name it:
``<param>/exp_avg``, ``<param>/exp_avg_sq``, ``<param>/step`` and, with an fp32 master copy,
``<param>/main``.

- :class:`CPUAdamW` — the Megatron optimizer needs CUDA (literal ``device='cuda'``
  tensors, ``torch.cuda.FloatTensor`` type checks), so on CPU the step is owned here:
  ``torch.optim.AdamW`` on the model parameters, reading the gradients Megatron DDP
  reduced into ``param.main_grad``, clipped to a global norm computed as Megatron does
  (tensor-parallel duplicates and shared parameters counted once, summed over the
  model-parallel group; expert-parallel parameters, held by one expert-parallel rank each,
  summed over expert TP × EP × PP and added, as Megatron's chained dense and expert
  optimizers add theirs). Float32 parameters only; no sharded state.
- :class:`MegatronAdamW` — Megatron's own optimizer on CUDA: the distributed optimizer
  (state sharded over data-parallel ranks in flat ranges) or the plain one, mixed precision
  with fp32 master weights for bf16/fp16 parameters. Built from the parameter groups here
  rather than ``get_megatron_optimizer``, whose group alignment is a world collective (the
  ranks of a new layout build it alone). Adam's step counters live on the CPU; they are
  mirrored on the device so that NCCL can move them, and written back by
  :meth:`MegatronAdamW.commit_state`.

Runs on each trainer rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dynarl.backends.megatron._train_config import MegatronTrainConfig
from dynarl.errors import BackendError
from dynarl.migrate import LayoutGroups, param_names, state_tensor, state_tensors

__all__ = ["CPUAdamW", "MegatronAdamW", "TrainerOptimizer", "param_groups"]

_STATES = ("exp_avg", "exp_avg_sq")


class TrainerOptimizer(Protocol):
    """What the trainer needs of its optimizer, on either device."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and optimizer state under layout names."""
        ...

    def zero_grad(self) -> None:
        """Clear gradients before a step's first backward."""
        ...

    def step(self) -> float:
        """Step on the reduced gradients; the gradient norm before clipping."""
        ...

    def set_lr(self, lr: float) -> None:
        """Learning rate from the next step on."""
        ...

    def commit_state(self) -> None:
        """Write state that a reshard wrote into copies back to where the optimizer reads it."""
        ...

    def reload_params(self) -> None:
        """Refresh master copies after the model parameters were overwritten."""
        ...

    @property
    def step_count(self) -> int | None:
        """Adam's step count on this rank (None if it holds no state)."""
        ...


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Megatron's default parameter groups (``get_standard_config_overrides``): weight decay
    on matrices, none on biases and 1-D parameters; empty groups dropped."""
    decay: list[torch.nn.Parameter] = []
    plain: list[torch.nn.Parameter] = []
    for name, param in module.named_parameters():
        if param.requires_grad:
            (plain if param.dim() == 1 or name.endswith(".bias") else decay).append(param)
    groups = []
    for params, mult in ((decay, 1.0), (plain, 0.0)):
        if params:
            groups.append(
                {
                    "params": params,
                    "weight_decay": weight_decay * mult,
                    "wd_mult": mult,
                    "lr_mult": 1.0,
                    "is_expert_parallel": False,
                    "is_decoupled_lr": False,
                    "default_config": True,
                    "max_lr": None,
                    "min_lr": None,
                }
            )
    return groups


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero Adam state for every parameter without one (what AdamW creates at its first
    step), so that the state exists before any step and a reshard can write into it."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                for key in _STATES:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _main_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """The gradient Megatron DDP accumulated and reduced for ``param``."""
    grad: torch.Tensor = param.main_grad  # type: ignore[attr-defined]
    return grad


def _step_of(tensors: dict[str, torch.Tensor]) -> int | None:
    for name, tensor in tensors.items():
        if name.endswith("/step"):
            return int(tensor.item())
    return None


class CPUAdamW:
    """``torch.optim.AdamW`` owning the step on CPU, over Megatron DDP's ``main_grad``."""

    def __init__(
        self, module: torch.nn.Module, groups: LayoutGroups, config: MegatronTrainConfig
    ) -> None:
        if any(p.dtype != torch.float32 for p in module.parameters()):
            raise ValueError("the CPU trainer needs float32 parameters (no master weights)")
        self.module, self.config = module, config
        self._tp, self._mp = groups.groups["tp"].pg, groups.groups["mp"].pg
        self._expert_groups = None
        if groups.spec.ep > 1:
            self._expert_groups = (groups.groups["etp"].pg, groups.groups["tp_ep_pp"].pg)
        self.optimizer = torch.optim.AdamW(
            param_groups(module, config.weight_decay),
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            foreach=False,
        )
        _init_adam_state(self.optimizer)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters and Adam state of this rank under layout names."""
        return state_tensors(self.module, self.optimizer)

    def set_lr(self, lr: float) -> None:
        """Use learning rate ``lr`` from the next step on."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> float:
        """One AdamW step on the reduced ``main_grad`` s (collective over the model-parallel
        group for the norm); returns the norm before clipping."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        params = [p for p in self.module.parameters() if p.requires_grad]
        squares = torch.zeros((), dtype=torch.float32)
        expert_squares = torch.zeros((), dtype=torch.float32)
        for param in params:
            expert = self._expert_groups is not None and not getattr(param, "allreduce", True)
            tp = self._expert_groups[0] if self._expert_groups and expert else self._tp
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, tp):
                square = torch.norm(_main_grad(param).float(), 2) ** 2
                if expert:
                    expert_squares += square
                else:
                    squares += square
        dist.all_reduce(squares, group=self._mp)
        if self._expert_groups is not None:
            dist.all_reduce(expert_squares, group=self._expert_groups[1])
            squares += expert_squares
        norm = float(squares.sqrt())
        clip = self.config.clip_grad
        scale = clip / (norm + 1e-6) if clip is not None else 1.0
        for param in params:
            grad = _main_grad(param)
            param.grad = grad if scale >= 1.0 else grad * scale
        self.optimizer.step()
        for param in params:
            param.grad = None
        return norm

    def zero_grad(self) -> None:
        """Drop gradients (the reduced ones live in DDP's buffer, zeroed by DDP)."""
        self.optimizer.zero_grad(set_to_none=True)

    def commit_state(self) -> None:
        """Nothing to write back on CPU (the state tensors are the optimizer's own)."""

    def reload_params(self) -> None:
        """Nothing to refresh on CPU (no master copies)."""

    @property
    def step_count(self) -> int | None:
        """Adam's step count on this rank (None if it holds no state)."""
        return _step_of(self.state_tensors())


class MegatronAdamW:
    """Megatron's optimizer (distributed or not, mixed precision) on CUDA."""

    def __init__(
        self,
        ddp: Any,
        groups: LayoutGroups,
        config: MegatronTrainConfig,
        *,
        distributed: bool,
        pg_collection: Any,
    ) -> None:
        from megatron.core.optimizer import (
            OptimizerConfig,
            _get_megatron_optimizer_based_on_param_groups,
        )

        self.ddp, self.module = ddp, ddp.module
        dtype = next(self.module.parameters()).dtype
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1,
            adam_beta2=config.adam_beta2,
            adam_eps=config.adam_eps,
            clip_grad=config.clip_grad or 0.0,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=distributed,
        )
        mp, dp = groups.groups["mp"], groups.groups["dp"]
        self.optimizer = _get_megatron_optimizer_based_on_param_groups(
            config=opt_config,
            model_chunks=[ddp],
            param_groups=param_groups(ddp, config.weight_decay),
            per_model_buffers={0: ddp.buffers},
            model_parallel_group=mp.pg,
            data_parallel_group=dp.pg,
            data_parallel_group_gloo=None,
            data_parallel_group_idx=mp.pg.rank(),
            # Gradient statistics of the distributed optimizer: over its whole instance.
            intra_dist_opt_group=pg_collection.intra_dist_opt,
            distributed_optimizer_instance_id=0,
            pg_collection=pg_collection,
        )
        self.optimizer.tp_group = groups.groups["tp"].pg
        self.distributed = distributed
        self.master = dtype != torch.float32
        _init_adam_state(self.optimizer.optimizer)
        self._mirrors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _main_and_state(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, dict[str, Any]]]:
        """``(name, model param, main param, Adam state)`` for every parameter this rank
        holds optimizer state for."""
        opt = self.optimizer
        if self.distributed:
            for _, name, param in param_names(self.module):
                if param in opt.model_param_group_index_map:
                    tensors = opt._get_main_param_and_optimizer_states(param)
                    main = tensors["param"]
                    yield name, param, main, opt.optimizer.state[main]
            return
        pairs = zip(
            (p for g in getattr(opt, "float16_groups", []) for p in g),
            (p for g in getattr(opt, "fp32_from_float16_groups", []) for p in g),
            strict=True,
        )
        mains = {id(model): main for model, main in pairs}
        for _, name, param in param_names(self.module):
            main = mains.get(id(param), param)
            yield name, param, main, opt.optimizer.state[main]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters, master copies and Adam state of this rank under layout names; step
        counters as device mirrors (see :meth:`commit_state`)."""
        out = {name: param.data for _, name, param in param_names(self.module)}
        mirrors = {}
        for name, _, main, state in self._main_and_state():
            if self.master:
                out[state_tensor(name, "main")] = (
                    main.data.view(-1) if self.distributed else main.data
                )
            for key in _STATES:
                out[state_tensor(name, key)] = (
                    state[key].view(-1) if self.distributed else state[key]
                )
            step = state["step"]
            mirror = step.to(device=main.device, dtype=torch.float32, copy=True)
            out[state_tensor(name, "step")] = mirror
            mirrors[state_tensor(name, "step")] = (step, mirror)
        self._mirrors = mirrors
        return out

    def commit_state(self) -> None:
        """Copy the device mirrors of the step counters (written by a reshard) back into
        the optimizer's own CPU counters."""
        for step, mirror in self._mirrors.values():
            step.copy_(mirror.to(step.device, step.dtype))

    def set_lr(self, lr: float) -> None:
        """Use learning rate ``lr`` from the next step on."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def reload_params(self) -> None:
        """Refresh the fp32 master copies from the model parameters (after loading them)."""
        if self.master:
            self.optimizer.reload_model_params()

    def step(self) -> float:
        """Megatron's step (unscale, clip, AdamW, copy to model params, param all-gather);
        returns the gradient norm. Raises BackendError when Megatron skips the update."""
        ok, norm, _ = self.optimizer.step()
        if not ok:
            raise BackendError("Megatron skipped the optimizer step (inf/nan gradients)")
        return float(norm) if norm is not None else math.nan

    def zero_grad(self) -> None:
        """Megatron's ``zero_grad`` (the model's grad buffer is zeroed by DDP)."""
        self.optimizer.zero_grad()

    def param_ranges(self) -> dict[str, tuple[int, int]]:
        """The flat range of each parameter this rank's distributed optimizer owns, as the
        optimizer derived it (``{}`` without the distributed optimizer)."""
        if not self.distributed:
            return {}
        out = {}
        for _, name, param in param_names(self.module):
            if param in self.optimizer.model_param_group_index_map:
                found = self.optimizer._get_model_param_range_map(param)["param"]
                out[name] = (int(found.start), int(found.end))
        return out

    @property
    def step_count(self) -> int | None:
        """Adam's step count on this rank (None if it holds no state)."""
        for _, _, _, state in self._main_and_state():
            return int(state["step"].item())
        return None
