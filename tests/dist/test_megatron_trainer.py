"""MegatronTrainer over gloo, two processes: DDP steps, P2P reshards, weight sync, HF round trip.

One two-rank job (run once for the module) drives a Llama-style Megatron GPTModel under
Megatron DDP (torch.optim.AdamW on ``main_grad``: the Megatron optimizer needs CUDA):

1. starts at (tp=2), takes two GRPO steps and one SFT step;
2. syncs its weights to two fake SGLang servers (running in this process; their
   weight-update groups are real gloo groups) through ``sync_weights``: gather to rank 0
   (planned by the reshard planner), Megatron → HF, buckets, broadcast, ``/weights_checker``;
3. reshards itself with P2PMigration (tp=2) → (dp=2) → (pp=2), checking the layout-free
   state checksum and the gathered full state bitwise before and after each move, and a
   second trainer restarted from the gathered state in the new layout: after each move
   both take the same steps and must agree bit for bit (losses and state);
4. loads a bfloat16 HF checkpoint directory (written here, no hub) into a fresh
   (tp=2) trainer and exports it back.

The tests then assert on what the ranks reported and on the servers' weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dynarl.backends.megatron import GPTModelConfig, describe, to_hf, write_hf_tensors
from dynarl.backends.megatron._hf_checkpoint import hf_config, read_hf_tensors
from dynarl.backends.sglang._server_launcher import free_port
from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._server import FakeSGLangServer

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
)
MOVES = [("dp2", {"dp": 2}), ("pp2", {"pp": 2})]


def batch(step: int, size: int = 6) -> list[Any]:
    """A deterministic GRPO batch of ``size`` sequences of 9..13 tokens."""
    from dynarl.backends._grpo import TrainSample

    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for i in range(size):
        length = 9 + (i + step) % 5
        tokens = torch.randint(0, MODEL.vocab_size, (length,), generator=gen).tolist()
        prompt = 3
        mask = [False] * prompt + [True] * (length - 1 - prompt)
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


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {
        n: t.detach().cpu().contiguous().view(torch.uint8).numpy().copy()
        if t.dim()
        else t.detach().cpu().reshape(1).view(torch.uint8).numpy().copy()
        for n, t in tensors.items()
    }


def _differs(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    return [
        n
        for n in sorted(set(a) | set(b))
        if n not in a or n not in b or a[n].tobytes() != b[n].tobytes()
    ]


def worker(rank: int, world: int, port: int, url: str, hf_dir: str, tmp: str) -> dict[str, Any]:
    from dynarl.backends.megatron import (
        MegatronTrainConfig,
        MegatronTrainer,
        export_hf_checkpoint,
        load_hf_checkpoint,
        model_config_from_hf,
        sync_weights,
    )
    from dynarl.backends.sglang import SGLangClient, WeightSyncConfig
    from dynarl.backends.sglang._client import ClientConfig
    from dynarl.errors import BackendError
    from dynarl.migrate import P2PMigration

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=world
    )
    out: dict[str, Any] = {"problems": [], "losses": [], "restarted_losses": []}
    problems: list[str] = out["problems"]
    config = MegatronTrainConfig(lr=3e-3, micro_batch_size=2, clip_grad=0.5, device="cpu")
    trainer = MegatronTrainer(MODEL, config, rank=rank, store=store)
    trainer.start(trainer.layout_spec((0, 1), tp=2), epoch=0)
    out["start_checksum"] = trainer.state_checksum()
    for step in range(2):
        out["losses"].append(trainer.train_step(batch(step)).loss)
    out["losses"].append(trainer.sft_step(batch(2)).loss)

    # Weight sync: every rank gathers; rank 0 pushes to two fake engines (one served by the
    # test process, one by rank 1's process: two engines cannot share a process, their
    # groups would have the same name) and verifies their /weights_checker checksums.
    async def sync(urls: list[str], port: str, hash_device: Any = "cuda") -> Any:
        sync_config = WeightSyncConfig(
            master_address="127.0.0.1",
            master_port=_shared_port(store, rank, port),
            backend="gloo",
            max_bucket_bytes=16 << 10,
            weight_version="v3",
            group_timeout_s=60,
        )
        clients = [SGLangClient(ClientConfig(base_url=url)) for url in urls] if rank == 0 else []
        try:
            return await sync_weights(trainer, clients, sync_config, checksum_device=hash_device)
        finally:
            for client in clients:
                await client.aclose()

    with contextlib.ExitStack() as stack:
        if rank == 1:
            fake = stack.enter_context(
                FakeSGLangServer.running_in_thread(
                    FakeSGLangConfig(step_interval_s=None), weights=engine_weights()
                )
            )
            store.set("fake-url", fake.url)
        urls = [url, store.get("fake-url").decode()]
        report = asyncio.run(sync(urls, "sync-port"))
        dist.barrier()
        # The engines hash with the CUDA kernel's function; expecting SHA-256 must fail.
        try:
            asyncio.run(sync(urls, "sync-port-2", hash_device="cpu"))
            out["wrong_hash"] = "no error"
        except BackendError as exc:
            out["wrong_hash"] = str(exc)
        dist.barrier()
        if rank == 1:
            out["engine"] = (_numpy(fake.model.weights), fake.scheduler.weight_version)
    full = trainer.gather(0)
    if rank == 0:
        assert report is not None
        out["sync"] = {
            "num_buckets": report.num_buckets,
            "num_tensors": report.num_tensors,
            "checksums": list(report.per_engine_checksums),
        }
        out["hf"] = _numpy(to_hf(full, MODEL))

    # Reshards, each checked against a trainer restarted from the gathered state.
    epoch, restarted = 1, None
    for index, (name, dims) in enumerate(MOVES):
        names = list(trainer.layout.tensor_map())
        before, digest = trainer.gather(0, names=names), trainer.state_checksum()
        path = pathlib.Path(tmp) / f"state{index}.pt"
        if rank == 0:
            torch.save(before, path)
        dist.barrier()
        dst = trainer.layout_for(trainer.layout_spec((0, 1), **dims))
        move = P2PMigration(
            migration_id=f"to-{name}",
            src=trainer.layout,
            dst=dst,
            rank=rank,
            store=store,
            epoch=epoch,
            trainer=trainer,
        )
        outcomes = [move.prepare(), move.transfer(), move.verify(), move.commit()]
        move.close()
        epoch += 1
        if not all(o.ok for o in outcomes):
            problems.append(f"{name}: {outcomes}")
        if trainer.state_checksum() != digest:
            problems.append(f"{name}: state checksum changed by the reshard")
        after = trainer.gather(0, names=names)
        if rank == 0:
            problems += [
                f"{name}: reshard changed {n}" for n in _differs(_numpy(before), _numpy(after))
            ]
        if restarted is not None:
            restarted.close()
        restarted = MegatronTrainer(MODEL, config, rank=rank, store=store, specs=trainer.specs)
        restarted.start(dst.spec, epoch=epoch)
        epoch += 1
        restarted.load_full(torch.load(path, weights_only=True))
        if restarted.state_checksum() != digest:
            problems.append(f"{name}: restart from the gathered state differs")
        for step in range(3 + 2 * index, 5 + 2 * index):
            mine, theirs = trainer.train_step(batch(step)), restarted.train_step(batch(step))
            out["losses"].append(mine.loss)
            out["restarted_losses"].append(theirs.loss)
            if mine != theirs:
                problems.append(f"{name} step {step}: {mine} != {theirs}")
        if trainer.state_checksum() != restarted.state_checksum():
            problems.append(f"{name}: states diverged after training on")
    out["final_layout"] = trainer.layout.name
    out["version"] = trainer.version
    restarted.close()
    trainer.close()

    # HF checkpoint directory → fresh (tp=2) trainer → export.
    hf_model = model_config_from_hf(json.loads((pathlib.Path(hf_dir) / "config.json").read_text()))
    loaded = MegatronTrainer(hf_model, config, rank=rank, store=store)
    loaded.start(loaded.layout_spec((0, 1), tp=2), epoch=epoch)
    load_hf_checkpoint(loaded, hf_dir)
    export_hf_checkpoint(
        loaded,
        pathlib.Path(tmp) / "exported",
        base_config=json.loads((pathlib.Path(hf_dir) / "config.json").read_text()),
    )
    loaded.close()
    dist.destroy_process_group()
    return out


def _shared_port(store: Any, rank: int, key: str) -> int:
    """A free port chosen by rank 0 and shared through the store."""
    if rank == 0:
        store.set(key, str(free_port()))
    return int(store.get(key).decode())


def hf_checkpoint(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    """A tiny bf16 Llama checkpoint with random weights, saved as an HF directory."""
    gen = torch.Generator().manual_seed(11)
    shapes = {
        name: torch.empty(spec.shape, device="meta")
        for name, spec in ((s.name, s) for s in describe(MODEL))
    }
    tensors = {
        n: torch.randn(t.shape, generator=gen).to(torch.bfloat16)
        for n, t in to_hf(shapes, MODEL).items()
    }
    config = hf_config(MODEL) | {"torch_dtype": "bfloat16", "bos_token_id": 1}
    write_hf_tensors(directory, tensors, config)
    return tensors


def engine_weights() -> dict[str, torch.Tensor]:
    """What a fake engine starts with: zeros under the model's HF names and shapes."""
    meta = {s.name: torch.empty(s.shape, device="meta") for s in describe(MODEL)}
    return {n: torch.zeros(t.shape) for n, t in to_hf(meta, MODEL).items()}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from migrate_ranks import run_ranks

    tmp = tmp_path_factory.mktemp("megatron")
    original = hf_checkpoint(tmp / "hf")
    config = FakeSGLangConfig(step_interval_s=None)
    with FakeSGLangServer.running_in_thread(config, weights=engine_weights()) as server:
        results = run_ranks(worker, 2, server.url, str(tmp / "hf"), str(tmp), timeout_s=280)
        mine = (_numpy(server.model.weights), server.scheduler.weight_version)
    engines = [mine, results[1]["engine"]]
    return {"results": results, "engines": engines, "tmp": tmp, "original": original}


def test_every_rank_reports_no_problem(job: dict[str, Any]) -> None:
    for rank, result in enumerate(job["results"]):
        assert result["problems"] == [], f"rank {rank}: {result['problems'][:5]}"


def test_ddp_steps_train_and_ranks_agree(job: dict[str, Any]) -> None:
    first, second = (r["losses"] for r in job["results"])
    assert first == second  # every rank reports the global batch's loss
    sft = first[2]
    assert len(first) == 3 + 2 * len(MOVES) and all(np.isfinite(first))
    assert sft > 3.0  # cross entropy of a near-uniform 128-way model
    assert job["results"][0]["version"] == 3 + 2 * len(MOVES)
    assert job["results"][0]["final_layout"] == "tp1-pp2-dp1"


def test_weight_sync_lands_bit_for_bit_on_both_engines(job: dict[str, Any]) -> None:
    sync, hf = job["results"][0]["sync"], job["results"][0]["hf"]
    assert sync["num_tensors"] == len(hf) and sync["num_buckets"] > 1
    assert len(set(sync["checksums"])) == 1
    for weights, version in job["engines"]:
        assert _differs(weights, hf) == []
        assert version == "v3"
    assert "weights differ after the sync" in job["results"][0]["wrong_hash"]
    assert job["results"][1]["wrong_hash"] == "no error"  # rank 1 only gathers


def test_hf_checkpoint_round_trips_bitwise_through_a_tp2_trainer(job: dict[str, Any]) -> None:
    exported = job["tmp"] / "exported"
    back = read_hf_tensors(exported)
    assert _differs(_numpy(back), _numpy(job["original"])) == []
    assert all(t.dtype == torch.bfloat16 for t in back.values())
    config = json.loads((exported / "config.json").read_text())
    original = json.loads((job["tmp"] / "hf" / "config.json").read_text())
    assert config == original


def test_megatron_distributed_optimizer_step_matches_cpu_adamw_at_tp2() -> None:
    """Megatron's distributed optimizer (CUDA type strings faked, tests/megatron_fake_cuda.py)
    and the CPU AdamW take the same clipped step at TP=2: the gradient norm is reduced over
    every rank of the layout, not over the data-parallel group alone."""
    from megatron_fake_cuda import tp2_worker
    from migrate_ranks import run_ranks

    result = run_ranks(tp2_worker, 2, timeout_s=200)[0]
    assert result["losses"][0] == result["losses"][1]
    assert result["norms"][0] == pytest.approx(result["norms"][1], rel=1e-5)
    assert result["norms"][1] > 0.05  # the clip was active
    assert result["max_param_diff"] < 1e-6
