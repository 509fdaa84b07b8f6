"""A real Megatron-core MoE GPT resharded between expert and tensor parallelism on CPU.

One two-rank gloo job (run once for the module) trains a tiny mixture-of-experts
GPTModel — 2 layers, 4 SwiGLU experts per layer, top-2, dropless, Megatron's local spec and
``allgather`` token dispatcher — with :class:`MegatronTrainer` (Megatron DDP, AdamW on
``main_grad``):

1. builds both layouts, (ep=2, tp=1, dp=2) and (ep=1, tp=2, sequence parallel), and
   cross-checks each rank's shards — experts by global index, the router, the gated
   ``linear_fc1`` halves, the dense parameters — against the model's own
   ``sharded_state_dict()`` (and, as a control, the EP model against the TP layout, which
   must disagree); both start from the same state checksum;
2. trains two steps at (ep=2), saves the gathered full state, reshards P2P to (ep=1, tp=2),
   restarts a second trainer in (ep=1, tp=2) from the saved state, and takes one step on
   each: losses, gradient norms and the whole state must be bitwise equal;
3. does the same back from (ep=1, tp=2) to (ep=2);
4. maps the gathered weights to Hugging Face Qwen-MoE names and back.

Every reshard must also leave the gathered state unchanged bit for bit and move exactly the
bytes a destination rank lacks (element masks, computed here).
"""

from __future__ import annotations

import pathlib
from collections import Counter
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dynarl.backends.megatron import GPTModelConfig

pytestmark = pytest.mark.dist

MODEL = GPTModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=128,
    max_sequence_length=64,
    init_seed=7,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
)
LAYOUTS = {"ep2": {"dp": 2, "expert_parallel": 2}, "tp2": {"tp": 2}}


def batch(step: int, size: int = 6) -> list[Any]:
    """A deterministic GRPO batch of ``size`` sequences of 9..13 tokens."""
    from dynarl.backends._grpo import TrainSample

    gen = torch.Generator().manual_seed(300 + step)
    out = []
    for i in range(size):
        length = 9 + (i + step) % 5
        tokens = torch.randint(0, MODEL.vocab_size, (length,), generator=gen).tolist()
        mask = [False] * 3 + [True] * (length - 4)
        old = torch.randn(length - 1, generator=gen).mul(0.1).add(-4.8).tolist()
        out.append(
            TrainSample(
                tokens=tuple(tokens),
                loss_mask=tuple(mask),
                advantage=(i % 3) - 1.0,
                old_logprobs=tuple(old),
            )
        )
    return out


def _bits(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """Each tensor's bytes."""
    return {
        n: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for n, t in tensors.items()
    }


def minimum_bytes(src: Any, dst: Any) -> int:
    """Bytes of destination elements their rank does not hold already (element masks)."""
    specs = src.tensor_map()
    held: dict[tuple[str, int], np.ndarray] = {}
    for shard in src.shards:
        mask = held.setdefault(
            (shard.tensor, shard.rank), np.zeros(specs[shard.tensor].shape, bool)
        )
        mask[shard.region.slices() or ...] = True
    total = 0
    for shard in dst.shards:
        need = np.ones(shard.region.sizes, bool)
        mask = held.get((shard.tensor, shard.rank))
        if mask is not None:
            need &= ~mask[shard.region.slices() or ...]
        total += int(need.sum()) * specs[shard.tensor].itemsize
    return total


def cross_check(trainer: Any, rank: int, other: Any) -> dict[str, Any]:
    """The layout against Megatron's sharded_state_dict on this rank (what was compared,
    what differed), and the same model against ``other``'s layout (must differ)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from dynarl.migrate import param_names
    from dynarl.migrate._megatron_layout import sharded_state_dict_mismatches

    metadata = {"dp_cp_group": trainer.groups.groups["dp"].pg}
    names = {local: name for local, name, _ in param_names(trainer.module)}
    compared: Counter[str] = Counter()
    for local, item in trainer.module.sharded_state_dict(metadata=metadata).items():
        if local in names and isinstance(item, ShardedTensor | ShardedTensorFactory):
            kind = "expert" if ".experts." in local else "router" if "router" in local else "dense"
            compared[kind + ("-glu" if isinstance(item, ShardedTensorFactory) else "")] += 1
    return {
        "compared": dict(compared),
        "problems": sharded_state_dict_mismatches(
            trainer.module, trainer.layout, rank, metadata=metadata
        ),
        "control": len(
            sharded_state_dict_mismatches(trainer.module, other, rank, metadata=metadata)
        ),
    }


def worker(rank: int, world: int, port: int, tmp: str) -> dict[str, Any]:
    from dynarl.backends.megatron import MegatronTrainConfig, MegatronTrainer, from_hf, to_hf
    from dynarl.migrate import P2PMigration

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=world
    )
    out: dict[str, Any] = {"problems": [], "steps": [], "moves": [], "checks": {}}
    problems: list[str] = out["problems"]
    config = MegatronTrainConfig(lr=3e-3, micro_batch_size=3, clip_grad=0.5, device="cpu")
    trainer = MegatronTrainer(MODEL, config, rank=rank, store=store)
    specs = {name: trainer.layout_spec((0, 1), **dims) for name, dims in LAYOUTS.items()}
    layouts = {name: trainer.layout_for(spec) for name, spec in specs.items()}
    out["sequence_parallel"] = {name: spec.sequence_parallel for name, spec in specs.items()}

    # 1. Both layouts, built and cross-checked; the same initial state in both.
    trainer.start(specs["ep2"], epoch=0)
    out["checks"]["ep2"] = cross_check(trainer, rank, layouts["tp2"])
    fresh = MegatronTrainer(MODEL, config, rank=rank, store=store, specs=trainer.specs)
    fresh.start(specs["tp2"], epoch=1)
    out["checks"]["tp2"] = cross_check(fresh, rank, layouts["ep2"])
    out["start_checksums"] = (trainer.state_checksum(), fresh.state_checksum())
    fresh.close()

    # 2-3. Train, reshard, compare with a trainer restarted from the saved state.
    for step in range(2):
        out["steps"].append(("ep2", trainer.train_step(batch(step)).loss))
    epoch, step = 2, 2
    for index, target in enumerate(("tp2", "ep2")):
        names = list(trainer.layout.tensor_map())
        before, digest = trainer.gather(0, names=names), trainer.state_checksum()
        path = pathlib.Path(tmp) / f"state{index}.pt"
        if rank == 0:
            torch.save(before, path)
        dist.barrier()
        move = P2PMigration(
            migration_id=f"to-{target}",
            src=trainer.layout,
            dst=layouts[target],
            rank=rank,
            store=store,
            epoch=epoch,
            trainer=trainer,
        )
        outcomes = [move.prepare(), move.transfer(), move.verify(), move.commit()]
        move.close()
        epoch += 1
        assert move.plan is not None
        out["moves"].append(
            {
                "target": target,
                "ok": [o.ok for o in outcomes],
                "bytes_moved": move.plan.bytes_moved,
                "min_bytes": minimum_bytes(move.src, move.dst),
                "layout": trainer.layout.name,
            }
        )
        if trainer.state_checksum() != digest:
            problems.append(f"{target}: the reshard changed the state checksum")
        after = trainer.gather(0, names=names)
        if rank == 0 and _bits(before) != _bits(after):
            problems.append(f"{target}: the reshard changed the gathered state")
        restarted = MegatronTrainer(MODEL, config, rank=rank, store=store, specs=trainer.specs)
        restarted.start(specs[target], epoch=epoch)
        epoch += 1
        restarted.load_full(torch.load(path, weights_only=True))
        if restarted.state_checksum() != digest:
            problems.append(f"{target}: the restart from the saved state differs")
        mine, theirs = trainer.train_step(batch(step)), restarted.train_step(batch(step))
        out["steps"].append((target, mine.loss, theirs.loss, mine.grad_norm, theirs.grad_norm))
        if mine != theirs:
            problems.append(f"{target} step {step}: resharded {mine} != restarted {theirs}")
        if trainer.state_checksum() != restarted.state_checksum():
            problems.append(f"{target} step {step}: the states differ after the step")
        restarted.close()
        step += 1

    # 4. The weights under Hugging Face names, and back.
    full = trainer.gather(0)
    if rank == 0:
        hf = to_hf(full, MODEL)
        out["hf_names"] = sorted(hf)
        out["hf_round_trip"] = _bits(from_hf(hf, MODEL)) == _bits(full)
    trainer.close()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from migrate_ranks import run_ranks

    return run_ranks(worker, 2, str(tmp_path_factory.mktemp("moe")), timeout_s=240)


def test_every_rank_reports_no_problem(job: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(job):
        assert result["problems"] == [], f"rank {rank}: {result['problems'][:5]}"


def test_layouts_match_megatrons_sharded_state_dict(job: list[dict[str, Any]]) -> None:
    for result in job:
        ep2, tp2 = result["checks"]["ep2"], result["checks"]["tp2"]
        assert ep2["problems"] == [] and tp2["problems"] == []
        # Per rank: 2 layers x 2 (ep=2) or 4 (tp=2) experts, each a gated fc1 and an fc2;
        # embeddings, output, final norm and per layer qkv, proj and two norms.
        assert ep2["compared"] == {"expert": 4, "expert-glu": 4, "router": 2, "dense": 11}
        assert tp2["compared"] == {"expert": 8, "expert-glu": 8, "router": 2, "dense": 11}
        assert ep2["control"] > 0 and tp2["control"] > 0
    assert job[0]["sequence_parallel"] == {"ep2": False, "tp2": True}
    first, second = job[0]["start_checksums"]
    assert first == second  # expert-parallel ranks start from the same draw as the others


def test_reshards_move_the_minimum_and_keep_the_state(job: list[dict[str, Any]]) -> None:
    moves = job[0]["moves"]
    assert [m["layout"] for m in moves] == ["tp2-pp1-dp1-sp", "tp1-pp1-dp2-ep2"]
    for move in moves:
        assert move["ok"] == [True] * 4
        assert move["bytes_moved"] == move["min_bytes"] > 0


def test_next_step_after_a_reshard_is_bitwise_a_restart_in_the_target_layout(
    job: list[dict[str, Any]],
) -> None:
    assert job[0]["steps"] == job[1]["steps"]  # every rank reports the global batch's loss
    resharded = [s for s in job[0]["steps"] if len(s) == 5]
    assert [s[0] for s in resharded] == ["tp2", "ep2"]
    for _, loss, restarted_loss, norm, restarted_norm in resharded:
        assert loss == restarted_loss and norm == restarted_norm
        assert np.isfinite(loss) and norm > 0


def test_moe_weights_map_to_qwen_moe_names_and_back(job: list[dict[str, Any]]) -> None:
    names = job[0]["hf_names"]
    assert job[0]["hf_round_trip"]
    assert "model.layers.1.mlp.gate.weight" in names
    for part in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.0.mlp.experts.3.{part}.weight" in names
    assert not any(".mlp.gate_proj." in n or "linear_fc" in n for n in names)
