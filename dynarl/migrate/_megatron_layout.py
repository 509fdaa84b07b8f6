"""Megatron-core models as layouts: introspection, process groups, and the globals swap.

The one module of :mod:`dynarl.migrate` that knows Megatron. It never imports Megatron at
module level (the caller imports it, after the CPU shim where needed); functions that need
Megatron import it lazily.

- :func:`param_specs` reads a model chunk (``GPTModel`` or any module of Megatron TP
  layers) into :class:`ParamSpec` s: global names (transformer layers renumbered from
  ``layer_number``, experts from the experts module's expert-parallel rank), full shapes,
  TP (or expert TP) partition dimension and stride, pipeline placement. One EP rank's
  chunk describes every expert: the experts of ``SequentialMLP`` (local spec,
  ``experts.local_experts.<i>.*``) and ``TEGroupedMLP`` (``experts.linear_fc1.weight<i>``)
  are all alike. The legacy ``GroupedMLP`` (all local experts in one tensor) is refused.
- :func:`process_group_collection` turns this rank's :class:`LayoutGroups` into the
  ``ProcessGroupCollection`` that ``GPTModel(pg_collection=...)`` takes, so every layout
  lives on its own groups and ``initialize_model_parallel`` is never called per layout.
- :func:`install_parallel_state` swaps the module-level groups Megatron still reads
  (``tensor_parallel.vocab_parallel_cross_entropy`` and the RNG tracker read the global
  tensor-parallel group) at commit, and returns what it replaced for a rollback.
- :func:`state_tensors` names a model's parameters and its ``torch.optim.Adam`` state the
  way a layout does; :func:`sharded_state_dict_mismatches` cross-checks a layout's
  parameter shards (strided gate/up halves and experts included) against the model's own
  ``sharded_state_dict()``.

Runs on each trainer rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dynarl.migrate._groups import LayoutGroups
from dynarl.migrate._layout import Layout, ParamSpec, Stage, state_tensor
from dynarl.migrate._region import Region

__all__ = [
    "install_parallel_state",
    "merge_stage_specs",
    "param_names",
    "param_specs",
    "process_group_collection",
    "restore_parallel_state",
    "sharded_state_dict_mismatches",
    "state_tensors",
]

_LAYER = re.compile(r"^(?P<stack>.*\blayers)\.(?P<index>\d+)\.(?P<rest>.*)$")
# An expert parameter of SequentialMLP (local spec) or TEGroupedMLP: the experts module,
# the expert's local index, and the name with that index as a format field.
_EXPERT_PATTERNS = (
    re.compile(r"^(?P<module>.*\.experts)\.local_experts\.(?P<index>\d+)(?P<rest>\..*)$"),
    re.compile(
        r"^(?P<module>.*\.experts)(?P<rest>\.linear_fc[12]\.(?:weight|bias))(?P<index>\d+)$"
    ),
)


@dataclass(frozen=True, slots=True)
class _Expert:
    module: str
    index: int
    template: str


def _split_expert(name: str) -> _Expert | None:
    for pattern, template in zip(
        _EXPERT_PATTERNS, ("{module}.local_experts.{{}}{rest}", "{module}{rest}{{}}"), strict=True
    ):
        match = pattern.match(name)
        if match is not None:
            text = template.format(module=match["module"], rest=match["rest"])
            return _Expert(match["module"], int(match["index"]), text)
    return None


def param_names(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """``(local name, global name, parameter)`` for every trainable parameter, in order.

    The global name replaces a local transformer-layer index with ``layer_number - 1`` and
    a local expert index ``i`` with ``ep_rank * num_local_experts + i`` (the experts
    module's expert-parallel group rank).
    """
    modules = dict(model.named_modules())
    for local, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = local
        match = _LAYER.match(local)
        if match is not None:
            layer = modules[f"{match['stack']}.{match['index']}"]
            number = int(getattr(layer, "layer_number", int(match["index"]) + 1)) - 1
            name = f"{match['stack']}.{number}.{match['rest']}"
        expert = _split_expert(local)
        if expert is not None:
            module = modules[expert.module]
            first = module.ep_group.rank() * int(module.num_local_experts)
            global_expert = _split_expert(name)
            assert global_expert is not None
            name = global_expert.template.format(first + expert.index)
        yield local, name, param


def param_specs(model: torch.nn.Module, *, tp: int) -> list[ParamSpec]:
    """Describe every trainable parameter of a model chunk built with TP size ``tp``.

    Expert parameters are described for every global expert (``ep_group.size() *
    num_local_experts`` of them, in the order a model built with ``ep = 1`` registers
    them), their split dimension scaled by the experts module's expert-TP size. Raises
    ValueError naming the parameter for an expert parameter of another kind (the legacy
    ``GroupedMLP``'s ``experts.weight1``) and when a Megatron TP layer's weight lacks its
    tensor-parallel attributes: with ``use_cpu_initialization`` and
    ``perform_initialization=False`` Megatron 0.16.1 never sets them, so describe the
    model from an initialised instance (the description holds for every layout).
    """
    _check_tp_attributes(model)
    modules = dict(model.named_modules())
    out: list[ParamSpec] = []
    run: list[tuple[_Expert, _Expert, torch.nn.Parameter]] = []
    for local, name, param in param_names(model):
        expert = _split_expert(local)
        if (expert is None and not getattr(param, "allreduce", True)) or ".experts.weight" in name:
            raise ValueError(
                f"expert_parallel: parameter {name!r} is an expert parameter of an unsupported "
                "kind (use the local spec's SequentialMLP or TEGroupedMLP)"
            )
        if run and (expert is None or expert.module != run[0][0].module):
            out.extend(_expert_specs(run, modules))
            run = []
        if expert is None:
            out.append(_param_spec(name, param, tp, None))
        else:
            renamed = _split_expert(name)
            assert renamed is not None
            run.append((expert, renamed, param))
    out.extend(_expert_specs(run, modules))
    return out


def _param_spec(name: str, param: torch.nn.Parameter, tp: int, expert: int | None) -> ParamSpec:
    split = bool(getattr(param, "tensor_model_parallel", False))
    dim = int(param.partition_dim) if split else None  # type: ignore[attr-defined]
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= tp
    match = _LAYER.match(name)
    if match is not None:
        stage, layer = Stage.LAYER, int(match["index"])
    else:
        stage, layer = (Stage.FIRST if name.startswith("embedding") else Stage.LAST), None
    return ParamSpec(
        name=name,
        shape=tuple(shape),
        tp_dim=dim,
        tp_stride=int(getattr(param, "partition_stride", 1)) if split else 1,
        stage=stage,
        layer=layer,
        shared_embedding=bool(getattr(param, "shared_embedding", False)),
        expert=expert,
    )


def _expert_specs(
    run: Sequence[tuple[_Expert, _Expert, torch.nn.Parameter]], modules: dict[str, Any]
) -> list[ParamSpec]:
    """One experts module's parameters, for every global expert, in ``ep = 1`` order."""
    if not run:
        return []
    module = modules[run[0][0].module]
    num_local = int(module.num_local_experts)
    total, etp = module.ep_group.size() * num_local, module.tp_group.size()
    keys = list(dict.fromkeys(renamed.template for _, renamed, _ in run))
    seen = [(local.index, renamed.template) for local, renamed, _ in run]
    if seen == [(i, k) for i in range(num_local) for k in keys]:
        order = [(e, k) for e in range(total) for k in keys]
    elif seen == [(i, k) for k in keys for i in range(num_local)]:
        order = [(e, k) for k in keys for e in range(total)]
    else:
        raise ValueError(
            f"expert_parallel: experts of {run[0][0].module!r} registered out of order"
        )
    first = {renamed.template: param for local, renamed, param in run if local.index == 0}
    return [_param_spec(key.format(e), first[key], etp, e) for e, key in order]


def _check_tp_attributes(model: torch.nn.Module) -> None:
    from megatron.core.tensor_parallel import layers

    kinds = (layers.ColumnParallelLinear, layers.RowParallelLinear, layers.VocabParallelEmbedding)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, kinds) and weight is not None:
            if not hasattr(weight, "tensor_model_parallel"):
                raise ValueError(
                    f"{name}.weight has no tensor-parallel attributes (built with "
                    "perform_initialization=False?); describe an initialised model instead"
                )


def merge_stage_specs(stages: Sequence[Sequence[ParamSpec]]) -> list[ParamSpec]:
    """Join per-stage descriptions (stage order) into the whole model's, first seen kept."""
    seen: dict[str, ParamSpec] = {}
    for specs in stages:
        for spec in specs:
            seen.setdefault(spec.name, spec)
    return list(seen.values())


def process_group_collection(groups: LayoutGroups) -> Any:
    """A Megatron ``ProcessGroupCollection`` over this rank's layout groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    g = {kind: group.pg for kind, group in groups.groups.items()}
    return ProcessGroupCollection(
        tp=g["tp"],
        pp=g["pp"],
        mp=g["mp"],
        cp=g["cp"],
        tp_cp=g.get("tp_cp", g["tp"]),
        embd=g.get("embd"),
        pos_embd=g.get("pos_embd"),
        dp=g["dp"],
        dp_cp=g.get("dp_cp", g["dp"]),
        intra_dp_cp=g.get("dp_cp", g["dp"]),
        # Without expert groups (ep = 1, no CP) the expert-parallel and expert-data-parallel
        # groups are this rank alone (cp): Megatron's DDP would otherwise create one with a
        # world-wide new_group.
        ep=g.get("ep", g["cp"]),
        expt_tp=g.get("etp", g["tp"]),
        tp_ep=g.get("tp_ep", g["tp"]),
        expt_dp=g.get("edp", g["cp"]),
        intra_expt_dp=g.get("edp", g["cp"]),
    )


# Module-level names of megatron.core.parallel_state that a layout defines on this rank,
# mapped to the LayoutGroups kinds they take, the first one present (a suffix _RANKS takes
# the ranks instead).
_GLOBALS: dict[str, tuple[str, ...]] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": ("tp",),
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": ("tp",),
    "_PIPELINE_MODEL_PARALLEL_GROUP": ("pp",),
    "_PIPELINE_GLOBAL_RANKS": ("pp",),
    "_MODEL_PARALLEL_GROUP": ("mp",),
    "_MODEL_PARALLEL_GLOBAL_RANKS": ("mp",),
    "_DATA_PARALLEL_GROUP": ("dp",),
    "_DATA_PARALLEL_GLOBAL_RANKS": ("dp",),
    "_DATA_PARALLEL_GROUP_WITH_CP": ("dp_cp", "dp"),
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": ("dp_cp", "dp"),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": ("dp_cp", "dp"),
    "_CONTEXT_PARALLEL_GROUP": ("cp",),
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": ("cp",),
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": ("tp_cp", "tp"),
    "_EMBEDDING_GROUP": ("embd",),
    "_EMBEDDING_GLOBAL_RANKS": ("embd",),
    "_POSITION_EMBEDDING_GROUP": ("pos_embd",),
    "_POSITION_EMBEDDING_GLOBAL_RANKS": ("pos_embd",),
    # Without expert groups: expert-parallel groups are this rank alone, expert TP is TP
    # and expert DP is DP (Megatron's defaults with ep = 1); the RNG seeding reads them.
    "_EXPERT_MODEL_PARALLEL_GROUP": ("ep", "cp"),
    "_EXPERT_TENSOR_PARALLEL_GROUP": ("etp", "tp"),
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ("tp_ep", "tp"),
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ("tp_ep_pp", "mp"),
    "_EXPERT_DATA_PARALLEL_GROUP": ("edp", "dp"),
}
_OVERRIDES = (
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
    "_MPU_DATA_PARALLEL_WORLD_SIZE",
    "_MPU_DATA_PARALLEL_RANK",
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE",
    "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
)


def install_parallel_state(groups: LayoutGroups | None) -> dict[str, Any]:
    """Point Megatron's process-wide parallel state at ``groups`` (None: clear it).

    Call it at commit, never earlier: until then the old layout keeps training on the old
    globals. Returns the previous values for :func:`restore_parallel_state`.
    """
    from megatron.core import parallel_state

    previous = {name: getattr(parallel_state, name) for name in (*_GLOBALS, *_OVERRIDES)}
    for name, kinds in _GLOBALS.items():
        found = [groups.groups[k] for k in kinds if k in groups.groups] if groups else []
        group = found[0] if found else None
        if group is None:
            value: Any = None
        elif name.endswith("_RANKS"):
            value = list(group.ranks)
        else:
            value = group.pg
        setattr(parallel_state, name, value)
    for name in _OVERRIDES:
        setattr(parallel_state, name, None)
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # layout-independent scratch memory
        parallel_state._set_global_memory_buffer()
    return previous


def restore_parallel_state(previous: dict[str, Any]) -> None:
    """Undo :func:`install_parallel_state`."""
    from megatron.core import parallel_state

    for name, value in previous.items():
        setattr(parallel_state, name, value)


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, init_state: bool = False
) -> dict[str, torch.Tensor]:
    """This rank's local tensors under layout names: parameters, and ``torch.optim.Adam``
    state (``exp_avg``, ``exp_avg_sq``, ``step``) when ``optimizer`` is given.

    ``init_state`` creates zero state for parameters that have none yet (a freshly built
    destination), so that a reshard can write into it. Raises ValueError when a parameter
    has no state and ``init_state`` is False.
    """
    out: dict[str, torch.Tensor] = {}
    for _, name, param in param_names(model):
        out[name] = param.data
        if optimizer is None:
            continue
        state = optimizer.state[param]
        if not state:
            if not init_state:
                raise ValueError(f"parameter {name!r} has no optimizer state yet")
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[state_tensor(name, key)] = state[key]
    return out


def sharded_state_dict_mismatches(
    model: Any, layout: Layout, rank: int, *, metadata: dict[str, Any] | None = None
) -> list[str]:
    """Where the layout's parameter shards on ``rank`` disagree with ``model``'s own
    ``sharded_state_dict()`` (global shape, offset, local shape per ShardedTensor).

    Returns human-readable differences; empty when they agree. For an expert parameter
    the offset on the expert axis Megatron prepends must be its global expert index too.
    A strided TP split (a gated ``linear_fc1``, dense or expert) is a
    ``ShardedTensorFactory`` in Megatron's state dict: it is built, and its pieces (the
    gate and up halves of this rank) must be exactly the layout's shards of the parameter.
    ``metadata`` is passed to ``sharded_state_dict`` (``{"dp_cp_group": ...}`` checks a
    model whose groups are not installed in Megatron's globals).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    specs = layout.tensor_map()
    mine: dict[str, list[Region]] = {}
    for placement in layout.placements_on(rank):
        mine.setdefault(placement.shard.tensor, []).append(placement.shard.region)
    names = {local: name for local, name, _ in param_names(model)}
    problems = []
    for local, item in model.sharded_state_dict(metadata=metadata).items():
        if local not in names or not isinstance(item, ShardedTensor | ShardedTensorFactory):
            continue
        name = names[local]
        if name not in mine:
            problems.append(f"{name}: in the model's state dict, not in the layout on rank {rank}")
            continue
        built = item.build() if isinstance(item, ShardedTensorFactory) else [item]
        pieces = [built] if isinstance(built, ShardedTensor) else list(built)
        expert = _split_expert(name)
        got = sorted(_megatron_box(piece, expert is not None) for piece in pieces)
        want = sorted(
            (specs[name].shape, region.offsets, region.sizes)
            + ((expert.index,) if expert is not None else ())
            for region in mine[name]
        )
        if got != want:
            problems.append(
                f"{name}: megatron (shape, offset, local[, expert]) {got} != layout {want}"
            )
    return problems


def _megatron_box(item: Any, expert: bool) -> tuple[Any, ...]:
    """``(global shape, global offset, local shape[, expert index])`` of a ShardedTensor,
    without the axes Megatron prepends (layer, and expert for an expert parameter, whose
    offset on that axis is the global expert index)."""
    lead = item.prepend_axis_num
    box: tuple[Any, ...] = (
        tuple(item.global_shape[lead:]),
        tuple(item.global_offset[lead:]),
        tuple(item.local_shape),
    )
    return box + ((item.global_offset[lead - 1] if lead else None,) if expert else ())
