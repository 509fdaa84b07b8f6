"""P2PMigration over gloo, 4 processes: abort at every phase, failed verify, lease, commit.

A plain tensor trainer (one local tensor per layout tensor) is resharded between two
layouts of a small GPT-shaped model. Aborting after prepare, after transfer or after verify
(then rolling back) must leave the old state bitwise intact and free every group; a
checksum mismatch on one rank must fail verify on all ranks; an expired lease refuses the
next step; a committed migration holds exactly the new layout's data, and repeated commands
answer from the log.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_reshard_executor import global_tensor, model, same_bits
from torch.distributed import distributed_c10d as c10d

from dynarl.migrate import (
    Layout,
    LayoutGroups,
    LayoutSpec,
    P2PMigration,
    Shard,
    Step,
    trainer_layout,
)

pytestmark = pytest.mark.dist

SRC = LayoutSpec(ranks=(0, 1, 2, 3), tp=2, dp=2, distributed_optimizer=True)
DST = LayoutSpec(ranks=(3, 2, 1, 0), tp=1, pp=2, dp=2)


class TensorTrainer:
    """Trainer state as plain local tensors, one per layout tensor on this rank."""

    def __init__(self, rank: int, layout: Layout, full: dict[str, torch.Tensor]) -> None:
        self.rank, self.layout = rank, layout
        self.tensors = self._fresh(layout)
        for p in layout.placements_on(rank):
            p.view(self.tensors[p.shard.tensor]).copy_(
                full[p.shard.tensor][p.shard.region.slices() or ...]
            )
        self.pending: dict[str, torch.Tensor] | None = None
        self.alias = False
        self.discarded = 0

    def _fresh(self, layout: Layout) -> dict[str, torch.Tensor]:
        specs = layout.tensor_map()
        return {
            t: torch.full(s, float("nan")).to(getattr(torch, specs[t].dtype))
            for t, s in layout.local_shapes_on(self.rank).items()
        }

    def shard_views(self) -> dict[Shard, torch.Tensor]:
        return {
            p.shard: p.view(self.tensors[p.shard.tensor])
            for p in self.layout.placements_on(self.rank)
        }

    def allocate(self, layout: Layout, groups: LayoutGroups | None) -> dict[Shard, torch.Tensor]:
        self.pending = self._fresh(layout)
        views = {
            p.shard: p.view(self.pending[p.shard.tensor]) for p in layout.placements_on(self.rank)
        }
        if self.alias:  # a broken allocation: two shards of equal shape share memory
            shards = [s for s, v in views.items() if v.dim() == 2]
            for s in shards[1:]:
                if views[s].shape == views[shards[0]].shape:
                    views[s] = views[shards[0]]
                    break
        if groups is not None:
            self.groups = groups
        return views

    def commit(self, layout: Layout) -> None:
        assert self.pending is not None
        self.tensors, self.layout, self.pending = self.pending, layout, None

    def discard(self, layout: Layout) -> None:
        self.pending = None
        self.discarded += 1


def holds(trainer: TensorTrainer, full: dict[str, torch.Tensor]) -> bool:
    return all(
        same_bits(v, full[s.tensor][s.region.slices() or ...])
        for s, v in trainer.shard_views().items()
    )


def dynarl_groups() -> list[str]:
    return [n for n in c10d._world.pg_names.values() if str(n).startswith("dynarl/")]


def scenario_worker(rank: int, world: int, port: int) -> dict[str, Any]:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    src, dst = trainer_layout(model(), SRC), trainer_layout(model(), DST)
    full = {t.name: global_tensor(t, seed=i) for i, t in enumerate(dst.tensors)}
    out: dict[str, Any] = {}
    epoch = 0

    def migration(name: str, trainer: TensorTrainer, **kw: Any) -> P2PMigration:
        nonlocal epoch
        epoch += 1
        return P2PMigration(
            migration_id=name,
            src=trainer.layout,
            dst=dst,
            rank=rank,
            store=store,
            epoch=epoch,
            trainer=trainer,
            **kw,
        )

    for abort_after in (Step.PREPARE, Step.TRANSFER, Step.VERIFY):
        trainer = TensorTrainer(rank, src, full)
        m = migration(f"abort-after-{abort_after}", trainer)
        steps = {Step.PREPARE: m.prepare, Step.TRANSFER: m.transfer, Step.VERIFY: m.verify}
        ok = True
        for step, fn in steps.items():
            ok &= fn().ok
            if step is abort_after:
                break
        aborted, rolled = m.abort("test"), m.rollback()
        out[str(abort_after)] = {
            "forward_ok": ok,
            "aborted": aborted.ok,
            "rolled_back": rolled.ok,
            "old_intact": holds(trainer, full),
            "groups_left": dynarl_groups(),
            "commit_refused": not m.commit().ok,
            "replay": m.rollback() == rolled,
            "phase": m.state.phase,
            "discarded": trainer.discarded,
        }

    trainer = TensorTrainer(rank, src, full)
    trainer.alias = rank == 2
    m = migration("bad-checksum", trainer)
    prepared, transferred, verified = m.prepare(), m.transfer(), m.verify()
    rolled = m.rollback()
    out["bad_checksum"] = {
        "transfer_ok": prepared.ok and transferred.ok,
        "verify": verified.ok,
        "detail": verified.detail,
        "rolled_back": rolled.ok,
        "old_intact": holds(trainer, full),
    }

    now = [0.0]
    trainer = TensorTrainer(rank, src, full)
    m = migration("lease", trainer, clock=lambda: now[0])
    first = [m.prepare().ok, m.transfer().ok]
    now[0] = 1e9
    late = m.verify()
    out["lease"] = {
        "first": first,
        "late": (late.ok, late.detail),
        "again": m.verify() == late,
        "rolled_back": m.rollback().ok,
        "old_intact": holds(trainer, full),
    }

    trainer = TensorTrainer(rank, src, full)
    m = migration("commit", trainer)
    committed = asyncio.run(m.migrate(dst.ranks))
    out["commit"] = {
        "step": str(committed.step),
        "ok": committed.ok,
        "new_exact": holds(trainer, full),
        "layout": trainer.layout.name,
        "replay": m.commit() == committed,
        "abort_refused": not m.abort().ok,
        "groups_left": dynarl_groups(),
    }
    if getattr(trainer, "groups", None) is not None:
        trainer.groups.close()
    out["groups_at_end"] = dynarl_groups()
    return out


def test_p2p_migration_aborts_verifies_and_commits(spawn_ranks: Any) -> None:
    results = spawn_ranks(scenario_worker, 4)
    for rank, r in enumerate(results):
        for step in ("prepare", "transfer", "verify"):
            a = r[step]
            assert a["forward_ok"] and a["aborted"] and a["rolled_back"], (rank, step, a)
            assert a["old_intact"] and a["groups_left"] == [] and a["discarded"] == 1, (
                rank,
                step,
                a,
            )
            assert a["commit_refused"] and a["replay"] and a["phase"] == "rolled_back"
        bad = r["bad_checksum"]
        assert bad["transfer_ok"] and not bad["verify"] and bad["rolled_back"] and bad["old_intact"]
        assert "checksum mismatch" in bad["detail"]
        lease = r["lease"]
        assert lease["first"] == [True, True] and lease["late"] == (False, "lease expired")
        assert lease["again"] and lease["rolled_back"] and lease["old_intact"]
        c = r["commit"]
        assert c["step"] == "commit" and c["ok"] and c["new_exact"] and c["layout"] == "tp1-pp2-dp2"
        assert c["replay"] and c["abort_refused"] and r["groups_at_end"] == []
    assert "on another rank" in results[0]["bad_checksum"]["detail"]
