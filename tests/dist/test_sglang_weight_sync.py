"""Weight sync trainer → SGLang over real gloo process groups (CPU).

1. Bucket broadcast between two processes standing in for the trainer's rank 0 and one
   engine rank, joined the way SGLang joins (``open_update_group``).
2. The whole sequence — Megatron tensors → HF → buckets → group init, begin, per-bucket
   ``update_weights_from_distributed`` + broadcast, end, destroy → ``/weights_checker`` —
   against two fake SGLang servers running as separate processes, which really join the
   group and receive the broadcast. A real SGLang needs NCCL and a GPU (``tests/gpu``).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pathlib

import pytest
import torch
from torch.distributed import distributed_c10d

from dynarl.backends.hf_layout import GPTLayout, megatron_to_hf
from dynarl.backends.sglang import (
    SGLangClient,
    WeightSyncConfig,
    checksum_mismatches,
    close_update_group,
    expected_checksums,
    open_update_group,
    plan_weight_sync,
    push_weights,
    receive_bucket,
)
from dynarl.backends.sglang._buckets import flatten_bucket
from dynarl.backends.sglang._server_launcher import SGLangServer, SGLangServerConfig, free_port
from dynarl.backends.sglang._weight_sync import broadcast_bucket
from dynarl.errors import BackendError

pytestmark = pytest.mark.dist

LAYOUT = GPTLayout(num_attention_heads=4, num_query_groups=2, head_dim=4, fc1_tp_size=2)


def _megatron(seed: int) -> dict[str, torch.Tensor]:
    """A two-layer GPT's full Megatron tensors (hidden 16, ffn 32, vocab 64), bf16 + fp32."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"embedding.word_embeddings.weight": (64, 16), "decoder.final_layernorm.weight": (16,)}
    for layer in range(2):
        prefix = f"decoder.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (16,),
            prefix + "self_attention.linear_qkv.weight": (32, 16),
            prefix + "self_attention.linear_proj.weight": (16, 16),
            prefix + "pre_mlp_layernorm.weight": (16,),
            prefix + "mlp.linear_fc1.weight": (64, 16),
            prefix + "mlp.linear_fc2.weight": (16, 32),
        }
    return {
        name: torch.randn(shape, generator=generator).to(
            torch.float32 if "layernorm" in name else torch.bfloat16
        )
        for name, shape in shapes.items()
    }


def _peer(rank: int, port: int, seed: int, limit: int) -> None:
    hf = megatron_to_hf(_megatron(seed), LAYOUT)
    plan = plan_weight_sync(hf, engine_tp_sizes=[1], max_bucket_bytes=limit)

    async def run() -> None:
        group = await asyncio.to_thread(
            open_update_group,
            master_address="127.0.0.1",
            master_port=port,
            rank=rank,
            world_size=2,
            group_name="weight_update_group",
            backend="gloo",
            timeout_s=60,
        )
        try:
            for bucket in plan.buckets:
                if rank == 0:
                    await broadcast_bucket(group, flatten_bucket(bucket, hf), 60)
                    continue
                for name, tensor in await receive_bucket(group, bucket, 60):
                    assert torch.equal(tensor.view(torch.uint8), hf[name].view(torch.uint8)), name
        finally:
            close_update_group(group)

    asyncio.run(run())


def test_bucket_broadcast_between_trainer_and_engine_processes() -> None:
    context = multiprocessing.get_context("spawn")
    port = free_port()
    peers = [context.Process(target=_peer, args=(rank, port, 7, 3000)) for rank in (0, 1)]
    for peer in peers:
        peer.start()
    for peer in peers:
        peer.join(120)
    codes = [peer.exitcode for peer in peers]
    for peer in peers:
        if peer.is_alive():
            peer.kill()
            peer.join()
    assert codes == [0, 0]


def _fake_config(
    tmp_path: pathlib.Path, name: str, weights: dict[str, torch.Tensor], tp: int = 1
) -> SGLangServerConfig:
    path = tmp_path / f"{name}.pt"
    torch.save(weights, path)
    return SGLangServerConfig(
        model_path=name,
        module="dynarl.testing.sglang_fake",
        tp_size=tp,
        extra_args=("--fake-weights", str(path)),
        health_poll_s=0.05,
        startup_timeout_s=60,
    )


def test_push_weights_to_two_engines_lands_bit_for_bit(tmp_path: pathlib.Path) -> None:
    old = megatron_to_hf(_megatron(1), LAYOUT)
    new = megatron_to_hf(_megatron(2), LAYOUT)

    async def main() -> None:
        async with (
            SGLangServer(_fake_config(tmp_path, "a", old)) as first,
            SGLangServer(_fake_config(tmp_path, "b", old)) as second,
        ):
            clients = [SGLangClient(first.client_config()), SGLangClient(second.client_config())]
            try:
                before = await clients[0].weights_checksum()
                assert checksum_mismatches(before, expected_checksums(old)) == []
                plan = plan_weight_sync(new, engine_tp_sizes=[1, 1], max_bucket_bytes=2048)
                assert plan.rank_offsets == (1, 2) and len(plan.buckets) > 2
                config = WeightSyncConfig(
                    master_address="127.0.0.1",
                    master_port=free_port(),
                    backend="gloo",
                    weight_version="step-2",
                    group_timeout_s=60,
                )
                await push_weights(clients, new, plan, config)
                for client in clients:
                    reply = await client.weights_checksum()
                    assert checksum_mismatches(reply, expected_checksums(new)) == []
                    assert reply.per_engine_checksum == expected_checksums(new).per_engine
                    assert (await client.model_info())["weight_version"] == "step-2"
            finally:
                for client in clients:
                    await client.aclose()

    asyncio.run(main())
    assert not distributed_c10d._world.pg_map, "the trainer's group was not destroyed"


def test_an_engine_that_refuses_to_join_fails_the_sync_within_the_deadline(
    tmp_path: pathlib.Path,
) -> None:
    weights = megatron_to_hf(_megatron(3), LAYOUT)

    async def main() -> None:
        async with SGLangServer(_fake_config(tmp_path, "tp2", weights, tp=2)) as server:
            async with SGLangClient(server.client_config()) as client:
                plan = plan_weight_sync(weights, engine_tp_sizes=[2], max_bucket_bytes=1 << 20)
                config = WeightSyncConfig(
                    master_address="127.0.0.1",
                    master_port=free_port(),
                    backend="gloo",
                    group_timeout_s=2,
                )
                with pytest.raises(
                    BackendError, match="joins weight-update groups only with tp_size=1"
                ):
                    await push_weights([client], weights, plan, config)
                assert not (await client.end_weight_update()).success  # no session was left open

    asyncio.run(main())
    assert not distributed_c10d._world.pg_map
