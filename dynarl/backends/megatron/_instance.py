"""One trainer layout made real on one rank: model, DDP and optimizer, cross-checked.

:func:`build_instance` builds this rank's GPTModel stage on the layout's groups, wraps it in
Megatron DDP, creates the optimizer for the device (:mod:`.optimizer`) and refuses the
result (``BackendError``) unless Megatron agrees with the layout the planner will move data
by:

- every parameter shard's global shape, offset and local shape equal the model's own
  ``sharded_state_dict()`` (:func:`dynarl.migrate.sharded_state_dict_mismatches`: experts
  by global index, gated ``linear_fc1`` halves included);
- with the distributed optimizer, the flat range of every parameter this rank owns, as the
  live optimizer derived it from DDP's buffers, equals the one the layout was built from
  (:func:`distributed_optimizer_mismatches`).

:class:`LayoutInstance` holds the result; the trainer keeps the current one and, during a
reshard, the one being filled. An expert-parallel layout starts from the whole model's
initial draw (:func:`initial_parameters`), not its ranks' own: Megatron draws a rank's
local experts from the same seed whichever experts they are. Runs on each trainer rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch._C._distributed_c10d import Store

from dynarl.backends.megatron._gpt_model import (
    build_gpt,
    initial_parameters,
    pg_collection,
    set_tp_attributes,
    wrap_ddp,
)
from dynarl.backends.megatron._optimizer import CPUAdamW, MegatronAdamW, TrainerOptimizer
from dynarl.backends.megatron._train_config import GPTModelConfig, MegatronTrainConfig
from dynarl.errors import BackendError
from dynarl.migrate import (
    BufferParam,
    CommGroup,
    Layout,
    LayoutGroups,
    ParamSpec,
    Shard,
    build_group,
    dp_buffer,
    dp_param_ranges,
    param_names,
    sharded_state_dict_mismatches,
)

__all__ = ["LayoutInstance", "build_instance", "distributed_optimizer_mismatches"]


@dataclass(kw_only=True, slots=True)
class LayoutInstance:
    """The live objects of one layout on this rank."""

    layout: Layout
    """The layout they implement."""
    groups: LayoutGroups
    """Its process groups on this rank."""
    module: torch.nn.Module
    """This rank's GPTModel stage."""
    ddp: torch.nn.Module
    """Megatron DDP around :attr:`module`."""
    optimizer: TrainerOptimizer
    """The optimizer, exposing its state under layout names."""
    store: Store = field(repr=False)
    """The job's store (groups are built over prefixes of it)."""
    timeout: timedelta
    """Deadline for building a group."""
    layout_group: CommGroup | None = None
    """A group over all the layout's ranks (gathers; the distributed optimizer's gradient
    statistics), built with the instance or by the first gather."""

    def views(self, rank: int) -> dict[Shard, torch.Tensor]:
        """Views of this rank's shards (writes go into the model and optimizer state)."""
        tensors = self.optimizer.state_tensors()
        return {p.shard: p.view(tensors[p.shard.tensor]) for p in self.layout.placements_on(rank)}

    def whole_group(self, rank: int) -> CommGroup:
        """:attr:`layout_group`, built now if needed (collective over the layout's ranks)."""
        if self.layout_group is None:
            device = next(self.module.parameters()).device
            self.layout_group = _layout_group(
                self.store, self.groups, self.layout, rank, device, self.timeout
            )
        return self.layout_group

    def close(self) -> None:
        """Destroy the layout's groups (the objects go with the last reference)."""
        if self.layout_group is not None:
            self.layout_group.close()
        self.groups.close()


def _layout_group(
    store: Store,
    groups: LayoutGroups,
    layout: Layout,
    rank: int,
    device: torch.device,
    timeout: timedelta,
) -> CommGroup:
    return build_group(
        store,
        name=f"dynarl/{groups.epoch}/layout/" + "-".join(map(str, layout.ranks)),
        ranks=layout.ranks,
        rank=rank,
        backend="nccl" if device.type == "cuda" else "gloo",
        timeout=timeout,
    )


def build_instance(
    model: GPTModelConfig,
    config: MegatronTrainConfig,
    layout: Layout,
    groups: LayoutGroups,
    specs: list[ParamSpec],
    *,
    rank: int,
    init: bool,
    device: torch.device,
    store: Store,
    timeout: timedelta,
    megatron_optimizer: bool,
) -> LayoutInstance:
    """Build and cross-check ``layout`` on this rank (see the module docstring); collective
    over the layout's ranks.

    ``init``: draw initial weights; otherwise the state is zeros (touched), ready to be
    written by a reshard. ``megatron_optimizer``: Megatron's optimizer (it needs CUDA
    tensors), else :class:`CPUAdamW`. Raises BackendError when Megatron disagrees with the
    layout.
    """
    assert layout.spec is not None
    spec = layout.spec
    module = build_gpt(model, spec, groups, rank=rank, init=init, device=device)
    set_tp_attributes(module, specs)
    if init and spec.ep > 1:
        # An expert-parallel rank's own draw depends on the experts it holds: take the
        # draw every other layout makes instead.
        _load_parameters(module, layout, rank, initial_parameters(model))
    if not init:
        with torch.no_grad():
            for param in module.parameters():
                param.zero_()
    ddp = wrap_ddp(module, spec, groups)
    whole = None
    optimizer: TrainerOptimizer
    if megatron_optimizer:
        if spec.distributed_optimizer:
            # Its gradient statistics are reduced over the whole optimizer instance: every
            # rank of the layout holds a different slice of the gradients.
            whole = _layout_group(store, groups, layout, rank, device, timeout)
        optimizer = MegatronAdamW(
            ddp,
            groups,
            config,
            distributed=spec.distributed_optimizer,
            pg_collection=pg_collection(groups, whole),
        )
    else:
        optimizer = CPUAdamW(module, groups, config)
    metadata = {"dp_cp_group": groups.groups["dp"].pg}
    problems = sharded_state_dict_mismatches(module, layout, rank, metadata=metadata)
    if isinstance(optimizer, MegatronAdamW) and optimizer.distributed:
        problems += distributed_optimizer_mismatches(module, layout, rank, optimizer.param_ranges())
    if problems:
        if whole is not None:
            whole.close()
        raise BackendError(f"layout {layout.name} disagrees with Megatron: {problems[:5]}")
    return LayoutInstance(
        layout=layout,
        groups=groups,
        module=module,
        ddp=ddp,
        optimizer=optimizer,
        store=store,
        timeout=timeout,
        layout_group=whole,
    )


@torch.no_grad()
def _load_parameters(
    module: torch.nn.Module, layout: Layout, rank: int, full: Mapping[str, torch.Tensor]
) -> None:
    """Copy this rank's shards of the full parameters ``full`` into ``module``."""
    params = {name: param for _, name, param in param_names(module)}
    for placement in layout.placements_on(rank):
        param = params.get(placement.shard.tensor)
        if param is not None:
            source = full[placement.shard.tensor][placement.shard.region.slices() or ...]
            placement.view(param.data).copy_(source)


def distributed_optimizer_mismatches(
    module: torch.nn.Module,
    layout: Layout,
    rank: int,
    ranges: Mapping[str, tuple[int, int]],
) -> list[str]:
    """Where the distributed optimizer's flat ranges on ``rank`` (``{name: (start, end)}``
    within each local parameter, as Megatron derived them) differ from the ones ``layout``
    places optimizer state by. Empty when they agree."""
    assert layout.spec is not None
    _, dp_rank, _ = layout.spec.coords(rank)
    params = [
        BufferParam(
            name=name, numel=p.numel(), shared_embedding=bool(getattr(p, "shared_embedding", False))
        )
        for _, name, p in param_names(module)
    ]
    buffer = dp_buffer(params, dp=layout.spec.dp, distributed_optimizer=True, bucket_size=None)
    ours = dp_param_ranges(buffer, dp_rank)
    shapes = layout.local_shapes_on(rank)
    problems = []
    for name in sorted(set(ours) | set(ranges)):
        size = shapes.get(f"{name}/exp_avg")
        want = ours.get(name)
        if ranges.get(name) != want or size != (None if want is None else (want[1] - want[0],)):
            problems.append(f"{name}: optimizer {ranges.get(name)}, layout {want} {size}")
    return problems
