"""Benchmark: MegatronTrainer weight sync to an SGLang engine, and a live reshard, vs raw.

Two ranks hold a Llama-shaped Megatron GPTModel at TP=2 (``--hidden``, ``--layers``,
``--vocab``; fp32 by default, about 100 MB). A fake SGLang engine (real gloo weight-update
group, HTTP control) runs in rank 1's process. Each repetition:

- ``sync_weights``: gather the TP shards on rank 0 (reshard planner + executor, checksummed)
  → HF names → buckets → broadcast inside begin/end → ``/weights_checker`` verification;
  the report splits ``gather_s``, ``push_s`` and ``verify_s``;
- baselines measured in the same run on the same two processes: ``raw_gather_s`` (rank 1
  sends its shard bytes to rank 0 in one message) and ``raw_broadcast_s`` (rank 0
  broadcasts the synced bytes to rank 1 over a fresh two-rank gloo group, in the same
  bucket sizes).

Then the trainer is resharded TP=2 → DP=2 and back with P2PMigration; ``pause_s`` is
transfer + verify + commit (the model/optimizer build is in ``prepare``, before the pause).
Ratios: ``push_ratio_to_raw = raw_broadcast_s / push_s``, ``gather_ratio_to_raw =
raw_gather_s / gather_s`` (1.0 = as fast as the raw transfer). Medians over ``--reps``.
``--device cuda`` puts the trainer on GPUs (NCCL groups; needs two GPUs, the weight-update
group stays gloo on host memory).

Run: ``.venv/bin/python bench/megatron_sync.py``. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dynarl.backends.megatron import GPTModelConfig, MegatronTrainConfig, describe, to_hf
from dynarl.backends.sglang import SGLangClient, WeightSyncConfig
from dynarl.backends.sglang._client import ClientConfig
from dynarl.backends.sglang._server_launcher import free_port
from dynarl.migrate import P2PMigration, build_group


def model(args: argparse.Namespace) -> GPTModelConfig:
    return GPTModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=args.hidden * 3,
        vocab_size=args.vocab,
        max_sequence_length=256,
    )


def raw_gather_s(store: Any, rank: int, nbytes: int, name: str) -> float:
    group = build_group(store, name=name, ranks=(0, 1), rank=rank)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    if rank == 1:
        dist.send(buf, group=group.pg, group_dst=0)
    else:
        dist.recv(buf, group=group.pg, group_src=1)
    elapsed = time.perf_counter() - start
    group.close()
    return elapsed


def raw_broadcast_s(store: Any, rank: int, sizes: list[int], name: str) -> float:
    group = build_group(store, name=name, ranks=(0, 1), rank=rank)
    bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]
    dist.barrier()
    start = time.perf_counter()
    for buf in bufs:
        dist.broadcast(buf, group=group.pg, group_src=0)
    elapsed = time.perf_counter() - start
    group.close()
    return elapsed


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    from dynarl.backends.megatron import MegatronTrainer, sync_weights
    from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
    from dynarl.testing.sglang_fake._server import FakeSGLangServer

    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=2)
    config = model(args)
    trainer = MegatronTrainer(
        config, MegatronTrainConfig(device=args.device, group_timeout_s=300), rank=rank, store=store
    )
    trainer.start(trainer.layout_spec((0, 1), tp=2), epoch=0)
    meta = {s.name: torch.empty(s.shape, device="meta") for s in trainer.specs}
    zeros = {n: torch.zeros(t.shape) for n, t in to_hf(meta, config).items()}
    engine = contextlib.ExitStack()
    if rank == 1:
        fake_config = FakeSGLangConfig(
            step_interval_s=None, group_timeout_s=300, checksum_device="cpu"
        )
        fake = engine.enter_context(FakeSGLangServer.running_in_thread(fake_config, weights=zeros))
        store.set("url", fake.url)
    url = store.get("url").decode()
    shard_bytes = sum(
        v.numel() * v.element_size() for s, v in trainer.shard_views().items() if s.tensor in meta
    )

    async def sync(port: int) -> Any:
        clients = [SGLangClient(ClientConfig(base_url=url))] if rank == 0 else []
        cfg = WeightSyncConfig(
            master_address="127.0.0.1", master_port=port, backend="gloo",
            max_bucket_bytes=args.bucket_mb << 20, group_timeout_s=300,
        )  # fmt: skip
        try:
            return await sync_weights(trainer, clients, cfg, checksum_device="cpu")
        finally:
            for client in clients:
                await client.aclose()

    reps = []
    for rep in range(args.reps + 1):
        if rank == 0:
            store.set(f"port{rep}", str(free_port()))
        dist.barrier()
        report = asyncio.run(sync(int(store.get(f"port{rep}").decode())))
        sizes: list[Any] = [None]
        if rank == 0:
            sizes[0] = [report.num_bytes]  # type: ignore[union-attr]
            timing = (report.gather_s, report.push_s, report.verify_s)  # type: ignore[union-attr]
            total_bytes = report.num_bytes  # type: ignore[union-attr]
            buckets = report.num_buckets  # type: ignore[union-attr]
        dist.broadcast_object_list(sizes, src=0)
        bucket = args.bucket_mb << 20
        parts = [min(bucket, sizes[0][0] - i) for i in range(0, sizes[0][0], bucket)]
        raw_b = _max(raw_broadcast_s(store, rank, parts, f"bench/raw-bcast/{rep}"))
        raw_g = _max(raw_gather_s(store, rank, shard_bytes, f"bench/raw-gather/{rep}"))
        if rep and rank == 0:  # the first repetition warms up
            reps.append(
                {
                    "gather_s": timing[0],
                    "push_s": timing[1],
                    "verify_s": timing[2],
                    "raw_broadcast_s": raw_b,
                    "raw_gather_s": raw_g,
                }
            )
    pauses = []
    epoch = 1
    for rep in range(args.reps):
        for dims in ({"dp": 2}, {"tp": 2}):
            dst = trainer.layout_for(trainer.layout_spec((0, 1), **dims))
            move = P2PMigration(
                migration_id=f"bench-{rep}-{epoch}", src=trainer.layout, dst=dst,  # type: ignore[arg-type]
                rank=rank, store=store, epoch=epoch, trainer=trainer,
            )  # fmt: skip
            epoch += 1
            assert move.prepare().ok
            dist.barrier()
            began = time.perf_counter()
            assert move.transfer().ok and move.verify().ok and move.commit().ok
            pauses.append(_max(time.perf_counter() - began))
            move.close()
    engine.close()
    trainer.close()
    if rank == 0:
        out.put(
            {
                "reps": reps,
                "pauses": pauses,
                "bytes": total_bytes,
                "buckets": buckets,
                "shard_bytes": shard_bytes,
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(json.dumps({"skipped": "--device cuda needs two GPUs (one NCCL rank per GPU)"}))
        return
    params = sum(torch.Size(s.shape).numel() for s in describe(model(args)))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    med = {k: statistics.median(r[k] for r in result["reps"]) for k in result["reps"][0]}
    report = {
        "device": args.device,
        "params": params,
        "sync_bytes": result["bytes"],
        "buckets": result["buckets"],
        **{k: round(v, 4) for k, v in med.items()},
        "push_ratio_to_raw": round(med["raw_broadcast_s"] / med["push_s"], 3),
        "gather_ratio_to_raw": round(med["raw_gather_s"] / med["gather_s"], 3),
        "sync_gbps": round(result["bytes"] / (med["gather_s"] + med["push_s"]) / 1e9, 3),
        "reshard_pause_s": round(statistics.median(result["pauses"]), 4),
    }
    print(
        f"{params / 1e6:.1f} M params, {result['bytes'] / 1e6:.1f} MB: "
        f"gather {med['gather_s']:.3f}s (raw {med['raw_gather_s']:.3f}s) "
        f"push {med['push_s']:.3f}s (raw {med['raw_broadcast_s']:.3f}s) "
        f"verify {med['verify_s']:.3f}s; reshard pause {report['reshard_pause_s']:.3f}s",
        file=sys.stderr,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
