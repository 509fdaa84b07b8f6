"""The Megatron trainer on CUDA (marker ``gpu``; skipped without CUDA).

What only a GPU exercises: GPTModel forward/backward on CUDA with the CPU shim NOT
applied; Megatron's own optimizer (FP32, mixed precision with fp32 master weights, the
distributed optimizer) behind MegatronTrainer, with its flat ranges cross-checked against
the layout at every build; NCCL groups built over a PrefixStore; a P2P reshard of CUDA
state (NCCL migration group, CUDA checksums, step counters mirrored on the device);
gathers and the weight sync from CUDA tensors. One GPU runs one rank; the two-rank test
needs two GPUs (several NCCL ranks cannot share one device).
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dynarl.backends._cpu_compat import cpu_shim_applied
from dynarl.backends._grpo import TrainSample
from dynarl.backends.megatron import (
    GPTModelConfig,
    MegatronTrainConfig,
    MegatronTrainer,
    describe,
    sync_weights,
    to_hf,
)
from dynarl.backends.reference import solo_process_group
from dynarl.migrate import P2PConfig, P2PMigration, build_group

pytestmark = [
    pytest.mark.gpu,
    # Megatron 0.16.1's RowParallelLinear warns on rank 0 that it passes no group.
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]


def model(dtype: str) -> GPTModelConfig:
    return GPTModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, vocab_size=256, max_sequence_length=64, params_dtype=dtype,
    )  # fmt: skip


CUDA = MegatronTrainConfig(lr=1e-3, micro_batch_size=2, device="cuda")


def batch(seed: int, vocab: int = 256) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(4):
        tokens = torch.randint(0, vocab, (12 + i,), generator=gen).tolist()
        mask = tuple([False] * 3 + [True] * (8 + i))
        out.append(TrainSample(tokens=tuple(tokens), loss_mask=mask, advantage=i - 1.5))
    return out


@pytest.fixture
def solo() -> Iterator[Any]:
    torch.cuda.set_device(0)
    with solo_process_group():
        yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))


def test_cpu_shim_is_not_applied_where_cuda_exists() -> None:
    from dynarl.backends.megatron._gpt_model import import_megatron

    import_megatron()
    assert not cpu_shim_applied()
    assert torch.cuda.current_device.__module__.startswith("torch.cuda")


def test_nccl_group_over_a_prefix_store() -> None:
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    group = build_group(store, name="dynarl/gpu/nccl-check", ranks=(0,), rank=0, backend="nccl")
    data = torch.arange(8.0, device="cuda")
    dist.all_reduce(data, group=group.pg)
    dist.broadcast(data, group=group.pg, group_src=0)
    torch.cuda.synchronize()
    assert data.tolist() == list(range(8))
    group.close()
    assert group.pg not in c10d._world.pg_map


@pytest.mark.parametrize(
    ("dtype", "distributed"),
    [("float32", False), ("bfloat16", False), ("bfloat16", True), ("float32", True)],
)
def test_gpt_trains_on_cuda_with_megatron_ddp_and_optimizer(
    solo: Any, dtype: str, distributed: bool
) -> None:
    trainer = MegatronTrainer(model(dtype), CUDA, rank=0, store=solo)
    try:
        trainer.start(trainer.layout_spec((0,), distributed_optimizer=distributed), epoch=0)
        assert trainer.module is not None and not cpu_shim_applied()
        assert all(p.is_cuda for p in trainer.module.parameters())
        losses = [trainer.sft_step(batch(0)).loss for _ in range(4)]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
        tensors = trainer._current.optimizer.state_tensors()  # type: ignore[union-attr]
        assert all(t.is_cuda for t in tensors.values())
        assert any(n.endswith("/main") for n in tensors) == (dtype != "float32")
        assert trainer.version == 4
        stats = trainer.train_step(batch(1))
        assert stats.version == 5 and stats.num_samples == 4
    finally:
        trainer.close()


def test_cuda_state_reshards_between_optimizer_layouts_bitwise(solo: Any) -> None:
    config = model("bfloat16")
    trainer = MegatronTrainer(config, CUDA, rank=0, store=solo)
    restarted = None
    try:
        trainer.start(trainer.layout_spec((0,), distributed_optimizer=True), epoch=0)
        for step in range(2):
            trainer.train_step(batch(step))
        for epoch, distributed in ((1, False), (3, True)):
            names = list(trainer.layout.tensor_map())  # type: ignore[union-attr]
            before, digest = trainer.gather(0, names=names), trainer.state_checksum()
            dst = trainer.layout_for(trainer.layout_spec((0,), distributed_optimizer=distributed))
            move = P2PMigration(
                migration_id=f"gpu-{epoch}", src=trainer.layout, dst=dst, rank=0, store=solo,  # type: ignore[arg-type]
                epoch=epoch, trainer=trainer, config=P2PConfig(backend="nccl"),
            )  # fmt: skip
            outcomes = [move.prepare(), move.transfer(), move.verify(), move.commit()]
            move.close()
            assert all(o.ok for o in outcomes), outcomes
            assert trainer.state_checksum() == digest
            if restarted is not None:
                restarted.close()
            restarted = MegatronTrainer(config, CUDA, rank=0, store=solo, specs=trainer.specs)
            restarted.start(dst.spec, epoch=epoch + 1)  # type: ignore[arg-type]
            restarted.load_full(before)
            assert restarted.state_checksum() == digest
            mine, theirs = trainer.train_step(batch(9)), restarted.train_step(batch(9))
            assert mine == theirs
            assert trainer.state_checksum() == restarted.state_checksum()
    finally:
        trainer.close()
        if restarted is not None:
            restarted.close()


def test_weight_sync_from_a_cuda_trainer_lands_bit_for_bit(
    solo: Any, tmp_path: pathlib.Path
) -> None:
    from dynarl.backends.sglang import SGLangClient, WeightSyncConfig
    from dynarl.backends.sglang._server_launcher import SGLangServer, SGLangServerConfig, free_port

    config = model("bfloat16")
    meta = {s.name: torch.empty(s.shape, device="meta") for s in describe(config)}
    path = tmp_path / "weights.pt"
    torch.save(
        {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in to_hf(meta, config).items()},
        path,
    )
    server_config = SGLangServerConfig(
        model_path="fake", module="dynarl.testing.sglang_fake",
        extra_args=("--fake-weights", str(path)), health_poll_s=0.05, startup_timeout_s=120,
    )  # fmt: skip
    trainer = MegatronTrainer(config, CUDA, rank=0, store=solo)
    trainer.start(trainer.layout_spec((0,), distributed_optimizer=True), epoch=0)
    trainer.train_step(batch(0))

    async def main() -> Any:
        async with (
            SGLangServer(server_config) as server,
            SGLangClient(server.client_config()) as client,
        ):
            sync = WeightSyncConfig(
                master_address="127.0.0.1",
                master_port=free_port(),
                backend="gloo",
                group_timeout_s=120,
            )
            return await sync_weights(trainer, [client], sync, checksum_device="cuda")

    try:
        report = asyncio.run(main())
        assert report is not None and report.num_tensors == len(to_hf(meta, config))
    finally:
        trainer.close()


def two_gpu_worker(rank: int, world: int, port: int) -> list[str]:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=world
    )
    trainer = MegatronTrainer(model("bfloat16"), CUDA, rank=rank, store=store)
    trainer.start(trainer.layout_spec((0, 1), tp=2), epoch=0)
    trainer.train_step(batch(0))
    digest = trainer.state_checksum()
    dst = trainer.layout_for(trainer.layout_spec((0, 1), dp=2, distributed_optimizer=True))
    move = P2PMigration(
        migration_id="tp2-to-dp2", src=trainer.layout, dst=dst, rank=rank, store=store,  # type: ignore[arg-type]
        epoch=1, trainer=trainer, config=P2PConfig(backend="nccl"),
    )  # fmt: skip
    outcomes = [move.prepare(), move.transfer(), move.verify(), move.commit()]
    move.close()
    after = trainer.state_checksum()
    trainer.train_step(batch(1))
    trainer.close()
    dist.destroy_process_group()
    return [str(all(o.ok for o in outcomes)), str(digest == after)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two NCCL ranks need two GPUs")
def test_tp2_trainer_reshards_to_distributed_optimizer_over_nccl() -> None:
    from migrate_ranks import run_ranks

    assert run_ranks(two_gpu_worker, 2) == [["True", "True"], ["True", "True"]]
