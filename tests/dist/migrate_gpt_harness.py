"""A small Megatron-core GPT trainer for the reshard tests: one per rank, any layout.

Each layout gets its own groups (built over a PrefixStore, never initialize_model_parallel)
and its own GPTModel built on them; ``torch.optim.Adam`` owns the step (the Megatron
optimizer needs CUDA). The global batch is fixed whatever the DP size: 8 sequences of 16
tokens per step, seeded by the step, split evenly over DP ranks; DP gradients are summed
with one all-reduce per parameter. Implements dynarl.migrate.ShardedTrainer.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dynarl.backends._cpu_compat import apply_cpu_shim
from dynarl.migrate import Layout, LayoutGroups, LayoutSpec, ParamSpec, Shard, trainer_layout
from dynarl.migrate._megatron_layout import (
    install_parallel_state,
    merge_stage_specs,
    param_specs,
    process_group_collection,
    state_tensors,
)

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 128
TIMEOUT = timedelta(seconds=60)


def import_megatron() -> None:
    apply_cpu_shim()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt  # noqa: F401


def build_model(spec: LayoutSpec, groups: LayoutGroups, *, init: bool) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        use_cpu_initialization=True,
        perform_initialization=init,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
    )
    torch.manual_seed(1234)
    coords = spec.coords(_my_rank(groups))
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=32,
        pg_collection=process_group_collection(groups),
        pre_process=coords[2] == 0,
        post_process=coords[2] == spec.pp - 1,
    )


def _my_rank(groups: LayoutGroups) -> int:
    (rank,) = groups.groups["cp"].ranks
    return rank


class GPTTrainer:
    """The trainer state of one rank (possibly none: a rank outside the layout)."""

    def __init__(self, rank: int, store: Any) -> None:
        self.rank, self.store = rank, store
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.layout: Layout | None = None
        self.groups: LayoutGroups | None = None
        self._pending: (
            tuple[torch.nn.Module, torch.optim.Optimizer, Layout, LayoutGroups] | None
        ) = None

    # -- starting a layout from scratch or from a full-state checkpoint -----------------
    def start(
        self,
        spec: LayoutSpec,
        epoch: int,
        full: dict[str, np.ndarray] | None = None,
        specs: list[ParamSpec] | None = None,
    ) -> None:
        """Build ``spec``'s groups and model: initialised, or loaded from a full state (then
        ``specs`` describes the model: an uninitialised Megatron model cannot)."""
        if self.rank not in spec.ranks:
            return
        groups = LayoutGroups.build(self.store, spec, rank=self.rank, epoch=epoch, timeout=TIMEOUT)
        model = build_model(spec, groups, init=full is None)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        layout = trainer_layout(specs or param_specs(model, tp=spec.tp), spec)
        if full is not None:
            tensors = state_tensors(model, optimizer, init_state=True)
            for p in layout.placements_on(self.rank):
                view = p.view(tensors[p.shard.tensor])
                view.copy_(torch.from_numpy(full[p.shard.tensor][p.shard.region.slices() or ...]))
        self.model, self.optimizer, self.layout, self.groups = model, optimizer, layout, groups
        install_parallel_state(groups)

    # -- ShardedTrainer ----------------------------------------------------------------
    def shard_views(self) -> dict[Shard, torch.Tensor]:
        if self.model is None or self.layout is None:
            return {}
        tensors = state_tensors(self.model, self.optimizer, init_state=False)
        return {
            p.shard: p.view(tensors[p.shard.tensor]) for p in self.layout.placements_on(self.rank)
        }

    def allocate(self, layout: Layout, groups: LayoutGroups | None) -> dict[Shard, torch.Tensor]:
        if groups is None:
            return {}
        assert layout.spec is not None
        model = build_model(layout.spec, groups, init=False)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        tensors = state_tensors(model, optimizer, init_state=True)
        for t in tensors.values():
            t.fill_(float("nan"))
        self._pending = (model, optimizer, layout, groups)
        return {p.shard: p.view(tensors[p.shard.tensor]) for p in layout.placements_on(self.rank)}

    def commit(self, layout: Layout) -> None:
        old = self.groups
        if self._pending is None:
            self.model = self.optimizer = self.layout = self.groups = None
            install_parallel_state(None)
        else:
            self.model, self.optimizer, self.layout, self.groups = self._pending
            self._pending = None
            install_parallel_state(self.groups)
        if old is not None:
            old.close()

    def discard(self, layout: Layout) -> None:
        if self._pending is not None:
            self._pending[3].close()
            self._pending = None

    # -- training ----------------------------------------------------------------------
    def train_step(self, step: int) -> float | None:
        """One optimizer step on the global batch of ``step``; the global mean loss."""
        if self.model is None or self.layout is None or self.groups is None:
            return None
        assert self.layout.spec is not None and self.optimizer is not None
        install_parallel_state(self.groups)  # two trainers may share this process
        spec, dp_group = self.layout.spec, self.groups.groups["dp"].pg
        _, dp_rank, _ = spec.coords(self.rank)
        gen = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        per = GLOBAL_BATCH // spec.dp
        mine = tokens[dp_rank * per : (dp_rank + 1) * per]
        inputs, labels = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
        position = torch.arange(SEQ).expand(per, SEQ)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        self.optimizer.zero_grad(set_to_none=False)
        if spec.pp == 1:
            losses = self.model(inputs, position, mask, labels=labels)
            total: torch.Tensor | None = losses.sum()
            assert total is not None
            (total / (GLOBAL_BATCH * SEQ)).backward()
        else:
            total = self._pipeline_step(inputs, labels, position, mask)
        for param in self.model.parameters():
            dist.all_reduce(param.grad, group=dp_group)
        self.optimizer.step()
        if total is None:
            return None
        summed = total.detach().reshape(1).clone()
        dist.all_reduce(summed, group=dp_group)
        return float(summed.item()) / (GLOBAL_BATCH * SEQ)

    def _pipeline_step(
        self, inputs: torch.Tensor, labels: torch.Tensor, position: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor | None:
        """Forward and backward through the stages, one microbatch (Megatron's own schedules
        allocate with device="cuda" and cannot run on CPU). Returns the loss sum on the last
        stage, None elsewhere."""
        assert self.model is not None and self.groups is not None and self.layout is not None
        assert self.layout.spec is not None
        pp = self.groups.groups["pp"]
        stage = pp.ranks.index(self.rank)
        last = stage == len(pp.ranks) - 1
        shape = (SEQ, inputs.shape[0], 32)
        if stage == 0:
            hidden_in = None
        else:
            hidden_in = torch.empty(shape)
            dist.recv(hidden_in, group=pp.pg, group_src=stage - 1)
            hidden_in.requires_grad_()
            self.model.set_input_tensor(hidden_in)
        if last:
            out = self.model(inputs if stage == 0 else None, position, mask, labels=labels)
            total = out.sum()
            (total / (GLOBAL_BATCH * SEQ)).backward()
        else:
            out = self.model(inputs if stage == 0 else None, position, mask)
            dist.send(out.detach().contiguous(), group=pp.pg, group_dst=stage + 1)
            grad = torch.empty(shape)
            dist.recv(grad, group=pp.pg, group_src=stage + 1)
            out.backward(grad)
            total = None
        if hidden_in is not None:
            assert hidden_in.grad is not None
            dist.send(hidden_in.grad.contiguous(), group=pp.pg, group_dst=stage - 1)
        return total

    def close(self) -> None:
        if self.groups is not None:
            self.groups.close()
        self.discard(self.layout)  # type: ignore[arg-type]


def describe_model(rank: int, store: Any) -> list[ParamSpec]:
    """The whole model's description from a one-rank (tp1, pp1) instance on this rank."""
    spec = LayoutSpec(ranks=(rank,))
    groups = LayoutGroups.build(store, spec, rank=rank, epoch=-1 - rank, timeout=TIMEOUT)
    try:
        return param_specs(build_model(spec, groups, init=True), tp=1)
    finally:
        groups.close()


def global_specs(trainer: GPTTrainer) -> list[ParamSpec]:
    """The whole model's description, merged from every pipeline stage (world collective)."""
    mine: tuple[int, list[ParamSpec]] = (-1, [])
    if trainer.model is not None and trainer.layout is not None and trainer.layout.spec:
        spec = trainer.layout.spec
        mine = (spec.coords(trainer.rank)[2], param_specs(trainer.model, tp=spec.tp))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    staged = sorted((g for g in gathered if g[0] >= 0), key=lambda g: g[0])
    return merge_stage_specs([s for _, s in staged])


def gather_full_state(trainer: GPTTrainer) -> dict[str, np.ndarray]:
    """Every tensor of the trainer state, assembled from all ranks (world collective)."""
    pieces = []
    if trainer.layout is not None:
        for shard, view in trainer.shard_views().items():
            pieces.append(
                (
                    shard.tensor,
                    shard.region.offsets,
                    shard.region.sizes,
                    view.detach().clone().numpy(),
                )
            )
        specs = {t.name: t.shape for t in trainer.layout.tensors}
    else:
        specs = {}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (specs, pieces))
    shapes: dict[str, tuple[int, ...]] = {}
    for s, _ in gathered:
        shapes.update(s)
    full = {name: np.full(shape, np.nan, dtype=np.float32) for name, shape in shapes.items()}
    for _, rank_pieces in gathered:
        for name, offsets, sizes, data in rank_pieces:
            full[name][
                tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True)) or ...
            ] = data
    return full


def same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """Names whose bits differ (or that one side lacks)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or a[n].tobytes() != b[n].tobytes()]
