"""Context parallelism trained on CUDA (marker ``gpu``): CP 2 against CP 1, its layout,
and a P2P reshard CP 2 → CP 1 (see ``cp_vpp_support.py`` for the design notes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cp_vpp_support import (
    BACKEND,
    CP_GRAD_RTOL,
    CP_LOSS_RTOL,
    CP_MODEL,
    STEPS,
    TIMEOUT,
    TRAIN,
    TWO_GPUS,
    activate,
    bitwise_equal,
    build_chunk,
    forward_backward,
    gather,
    need_te,
    relative_l2,
    samples,
    start_rank,
    te_attention,
)
from migrate_ranks import run_ranks

from dynarl.backends._grpo import TrainSample
from dynarl.backends.megatron import MegatronTrainer
from dynarl.backends.megatron._gpt_model import (
    describe,
    pg_collection,
    wrap_ddp,
)
from dynarl.backends.megatron._instance import LayoutInstance
from dynarl.backends.megatron._optimizer import MegatronAdamW
from dynarl.migrate import (
    Layout,
    LayoutGroups,
    LayoutSpec,
    P2PConfig,
    P2PMigration,
    ParamSpec,
    Shard,
    build_group,
    param_names,
    sharded_state_dict_mismatches,
    trainer_layout,
)

pytestmark = [
    pytest.mark.gpu,
    # Megatron 0.16.1's RowParallelLinear warns on rank 0 that it passes no group.
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]


def cp_spec(ranks: tuple[int, ...]) -> LayoutSpec:
    """(TP 1, CP len(ranks), DP 1), the distributed optimizer on, CP_MODEL's dtypes."""
    return LayoutSpec(
        ranks=ranks,
        context_parallel=len(ranks),
        distributed_optimizer=True,
        param_dtype=CP_MODEL.params_dtype,
        master_dtype="float32",
    )


def build_cp_instance(
    layout: Layout,
    groups: LayoutGroups,
    store: Any,
    *,
    rank: int,
    init: bool,
    specs: Sequence[ParamSpec],
) -> LayoutInstance:
    """``build_instance`` of the trainer for a CP layout: the model with TE attention,
    Megatron DDP (dense buffers over dp × cp, from the layout's groups) and ``MegatronAdamW``
    as the distributed optimizer. ``MegatronAdamW`` takes the optimizer's data-parallel
    group from ``groups["dp"]``; Megatron shards it over dp × cp (its ``intra_dp_cp``
    group, the one DDP's buffers use), so it is given a view with ``dp_cp`` there."""
    spec = layout.spec
    assert spec is not None
    module = build_chunk(
        CP_MODEL, spec, groups, rank=rank, vp_stage=None, init=init, specs=specs,
        core_attention=te_attention(),
    )  # fmt: skip
    activate(groups)
    ddp = wrap_ddp(module, spec, groups)
    whole = build_group(
        store,
        name=f"dynarl/{groups.epoch}/layout/" + "-".join(map(str, layout.ranks)),
        ranks=layout.ranks,
        rank=rank,
        backend=BACKEND,
        timeout=TIMEOUT,
    )
    dp_cp = groups.groups.get("dp_cp", groups.groups["dp"])
    sharding = LayoutGroups(epoch=groups.epoch, spec=spec, groups={**groups.groups, "dp": dp_cp})
    optimizer = MegatronAdamW(
        ddp, sharding, TRAIN, distributed=True, pg_collection=pg_collection(groups, whole)
    )
    return LayoutInstance(
        layout=layout, groups=groups, module=module, ddp=ddp, optimizer=optimizer,
        store=store, timeout=TIMEOUT, layout_group=whole,
    )  # fmt: skip


class CPTrainer:
    """The CP model as a P2P migration drives it (:class:`dynarl.migrate.ShardedTrainer`),
    with ``MegatronTrainer``'s allocate/commit semantics."""

    def __init__(self, store: Any, rank: int, specs: Sequence[ParamSpec]) -> None:
        self.store, self.rank, self.specs = store, rank, specs
        self.current: LayoutInstance | None = None
        self.pending: LayoutInstance | None = None

    def build(self, spec: LayoutSpec, epoch: int, *, init: bool = True) -> LayoutInstance:
        """``spec``'s layout built on new groups named by ``epoch`` (not made current)."""
        groups = LayoutGroups.build(
            self.store, spec, rank=self.rank, epoch=epoch, backend=BACKEND, timeout=TIMEOUT
        )
        layout = trainer_layout(self.specs, spec)
        return build_cp_instance(
            layout, groups, self.store, rank=self.rank, init=init, specs=self.specs
        )

    def shard_views(self) -> Mapping[Shard, torch.Tensor]:
        return self.current.views(self.rank) if self.current is not None else {}

    def allocate(self, layout: Layout, groups: LayoutGroups | None) -> Mapping[Shard, torch.Tensor]:
        if groups is None:
            return {}
        self.discard(layout)
        self.pending = build_cp_instance(
            layout, groups, self.store, rank=self.rank, init=False, specs=self.specs
        )
        return self.pending.views(self.rank)

    def commit(self, layout: Layout) -> None:
        old, self.current, self.pending = self.current, self.pending, None
        if self.current is not None:
            self.current.optimizer.commit_state()
            activate(self.current.groups)
        if old is not None:
            old.close()

    def discard(self, layout: Layout) -> None:
        if self.pending is not None:
            self.pending.close()
            self.pending = None


def cp_step(
    instance: LayoutInstance, batch: Sequence[TrainSample], *, grads: bool = False
) -> tuple[float | None, dict[str, torch.Tensor]]:
    """One optimizer step; the loss and, with ``grads``, every parameter's reduced
    gradient (fp32, on the CPU) before the update."""
    assert instance.layout.spec is not None
    instance.optimizer.zero_grad()
    loss = forward_backward(
        instance.layout.spec, instance.groups, [instance.ddp], batch,
        explicit_mask=False, force_all_reduce=grads,
    )  # fmt: skip
    captured = {}
    if grads:
        captured = {
            name: param.main_grad.detach().float().cpu().clone()  # type: ignore[attr-defined]
            for _, name, param in param_names(instance.module)
        }
    instance.optimizer.step()
    return loss, captured


def layout_ranges(layout: Layout, rank: int) -> dict[str, tuple[int, int]]:
    """The distributed optimizer's flat range of each parameter on ``rank`` (TP 1), read
    back from the layout's placements of ``<param>/exp_avg``."""
    shapes = layout.tensor_map()
    sizes = layout.local_shapes_on(rank)
    out: dict[str, tuple[int, int]] = {}
    for placement in layout.placements_on(rank):
        name, _, state = placement.shard.tensor.rpartition("/")
        if state != "exp_avg" or placement.flat_offset is None:
            continue
        first = 0
        for offset, size in zip(placement.shard.region.offsets, shapes[name].shape, strict=True):
            first = first * size + offset
        start = first - placement.flat_offset
        (length,) = sizes[placement.shard.tensor]
        assert out.setdefault(name, (start, start + length)) == (start, start + length)
    return out


def cp_layout_problems(instance: LayoutInstance, rank: int) -> list[str]:
    """Where Megatron disagrees with the layout on ``rank``: parameter shards against
    ``sharded_state_dict()``, flat ranges against the distributed optimizer's."""
    groups = instance.groups.groups
    metadata = {"dp_cp_group": groups.get("dp_cp", groups["dp"]).pg}
    problems = sharded_state_dict_mismatches(
        instance.module, instance.layout, rank, metadata=metadata
    )
    ours, theirs = layout_ranges(instance.layout, rank), instance.optimizer.param_ranges()  # type: ignore[attr-defined]
    if ours != theirs:
        problems.append(f"distributed optimizer ranges: megatron {theirs} != layout {ours}")
    return problems


def cp_train(instance: LayoutInstance) -> dict[str, Any]:
    """STEPS steps of ``instance``; the losses and the first step's gradients."""
    out: dict[str, Any] = {"losses": []}
    for step in range(STEPS):
        loss, grads = cp_step(instance, samples(0), grads=step == 0)
        out["losses"].append(loss)
        if step == 0:
            out["grads"] = grads
    return out


def cp_worker(rank: int, world: int, port: int) -> dict[str, Any]:
    """CP 2 on ranks (0, 1): layout checks, training, the reshard to CP 1 on rank 0, then
    on rank 0 the restart check and the CP 1 reference run."""
    store = start_rank(rank, world, port)
    specs = describe(CP_MODEL)
    trainer = CPTrainer(store, rank, specs)
    trainer.current = trainer.build(cp_spec((0, 1)), epoch=0)
    cp2 = trainer.current
    out: dict[str, Any] = {"layout": cp_layout_problems(cp2, rank)}
    out |= cp_train(cp2)
    before = gather(
        cp2.layout, cp2.optimizer.state_tensors(), rank=rank, root=0, group=cp2.whole_group(rank)
    )
    move = P2PMigration(
        migration_id="cp2-to-cp1", src=cp2.layout, dst=trainer_layout(specs, cp_spec((0,))),
        rank=rank, store=store, epoch=1, trainer=trainer,
        config=P2PConfig(backend=BACKEND, group_timeout_s=TIMEOUT.total_seconds()),
    )  # fmt: skip
    outcomes = [move.prepare(), move.transfer(), move.verify(), move.commit()]
    move.close()
    assert move.plan is not None
    out |= {
        "reshard": [o.detail for o in outcomes if not o.ok],
        "bytes_moved": move.plan.bytes_moved,
    }
    grads = out.pop("grads")
    if rank == 0:
        out |= cp1_checks(trainer, before, grads)
    if trainer.current is not None:
        trainer.current.close()
    dist.destroy_process_group()
    return out


def cp1_checks(
    trainer: CPTrainer, before: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """Rank 0 after the reshard to CP 1: its state against ``before`` (gathered from CP
    2), the restart check, and the CP 1 reference run against the CP 2 gradients
    ``grads`` of the first step."""
    cp1 = trainer.current
    assert cp1 is not None
    after = gather(
        cp1.layout, cp1.optimizer.state_tensors(), rank=0, root=0, group=cp1.whole_group(0)
    )
    out: dict[str, Any] = {"reshard_bitwise": bitwise_equal(before, after)}
    out |= cp_restart(trainer, before)
    reference = trainer.build(cp_spec((0,)), epoch=3)
    trained = cp_train(reference)
    out["reference"] = {"losses": trained["losses"], "layout": cp_layout_problems(reference, 0)}
    out["grad_error"] = relative_l2(grads, trained["grads"])
    reference.close()
    return out


def cp_restart(trainer: CPTrainer, full: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """A CP 1 model restarted from the gathered state ``full`` and the resharded one take
    the same step: equal losses, bitwise equal states (rank 0 alone)."""
    resharded = trainer.current
    assert resharded is not None
    restarted = trainer.build(cp_spec((0,)), epoch=2)
    tensors = restarted.optimizer.state_tensors()
    for placement in restarted.layout.placements_on(0):
        source = full[placement.shard.tensor][placement.shard.region.slices() or ...]
        placement.view(tensors[placement.shard.tensor]).copy_(source)
    restarted.optimizer.commit_state()
    mine, _ = cp_step(resharded, samples(9))
    theirs, _ = cp_step(restarted, samples(9))
    states = [
        gather(
            i.layout,
            i.optimizer.state_tensors(),
            rank=0,
            root=0,
            group=i.whole_group(0),
        )
        for i in (resharded, restarted)
    ]
    restarted.close()
    return {"restart_losses": (mine, theirs), "restart_bitwise": bitwise_equal(*states)}


@TWO_GPUS
@pytest.mark.timeout(480)
def test_cp2_trains_like_cp1_and_reshards_to_cp1_bitwise() -> None:
    need_te()
    rank0, rank1 = run_ranks(cp_worker, 2, timeout_s=420)
    for result in (rank0, rank1):
        assert result["layout"] == [], result["layout"]
        assert result["reshard"] == [], result["reshard"]
    assert rank0["losses"] == rank1["losses"]  # summed over the CP group
    # Rank 1's half of the optimizer state crosses; the parameters, replicated, do not.
    assert rank0["bytes_moved"] == rank1["bytes_moved"] > 0
    assert rank0["reshard_bitwise"]
    mine, theirs = rank0["restart_losses"]
    assert mine == theirs and rank0["restart_bitwise"]
    reference = rank0["reference"]
    assert reference["layout"] == []
    torch.testing.assert_close(
        torch.tensor(rank0["losses"]), torch.tensor(reference["losses"]), rtol=CP_LOSS_RTOL, atol=0
    )
    assert rank0["grad_error"] <= CP_GRAD_RTOL, rank0["grad_error"]
    assert reference["losses"][-1] < reference["losses"][0]


def cp_solo_worker(rank: int, world: int, port: int) -> dict[str, Any]:
    """One GPU: MegatronTrainer (local attention) and the CP 1 model with TE attention,
    STEPS steps each from the same weights."""
    store = start_rank(rank, world, port)
    trainer = MegatronTrainer(CP_MODEL, TRAIN, rank=0, store=store)
    trainer.start(trainer.layout_spec((0,), distributed_optimizer=True), epoch=0)
    expected = [trainer.sft_step(samples(0)).loss for _ in range(STEPS)]
    trainer.close()
    cp = CPTrainer(store, 0, describe(CP_MODEL))
    instance = cp.build(cp_spec((0,)), epoch=1)
    out = cp_train(instance)
    layout = cp_layout_problems(instance, 0)
    instance.close()
    dist.destroy_process_group()
    return {"expected": expected, "losses": out["losses"], "layout": layout}


def test_te_attention_model_trains_like_the_trainer_on_one_gpu() -> None:
    need_te()
    (result,) = run_ranks(cp_solo_worker, 1)
    assert result["layout"] == [], result["layout"]
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(result["expected"]), rtol=CP_LOSS_RTOL, atol=0
    )
    assert result["losses"][-1] < result["losses"][0]


# ---------------------------------------------------------------------- virtual pipeline
