"""The two real engines ``bench/priority.py`` replays on, behind one small interface (issue 20).

An :class:`Engine` says how to start a server with a given KV size, how to read its
counters (KV use, preemptions or retractions, prefix-cache lookups and hits), how to reset
its prefix cache, how the dispatcher's shadow should see its cache, and how the simulator
models it:

- :class:`VLLMEngine`: vLLM's CPU backend — KV in 128-token blocks
  (``--num-gpu-blocks-override``; one is the null block), a block-hash prefix cache, a
  waiting queue in arrival order, preemption by recompute when a decode step finds no free
  block;
- :class:`SGLangEngine`: SGLang 0.5.23 on CPU (its own venv, ``make sglang-env``) — KV in
  tokens (``--max-total-tokens``), a token-granular radix cache, admission that reserves a
  decaying share of running requests' future tokens (``new_token_ratio``), retraction when a
  decode step does not fit. Its OpenMP threads are pinned to one core
  (``SGLANG_CPU_OMP_THREADS_BIND``, one thread): by default SGLang binds a thread to every
  core of the NUMA node, and on this 2-core host a decode step then took 80–100 ms
  instead of 2.6 ms whenever another process was busy (measured: 100 tokens of the tiny
  model, 0.26 s pinned to an idle core; 200 tokens, 20 s unpinned beside one busy process).

``kv`` is the engine's own unit throughout: blocks for vLLM, tokens for SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from dynarl.backends.serving import EngineSetup
from dynarl.backends.sglang import ClientConfig, SGLangClient, SGLangServer, SGLangServerConfig
from dynarl.backends.vllm import VLLMClient, VLLMClientConfig, VLLMServer, VLLMServerConfig
from dynarl.sched import PrefixCache
from dynarl.sim import EngineProfile, RolloutSpec

__all__ = ["CONTEXT_MARGIN", "ENGINES", "Counters", "Engine", "SGLangEngine", "VLLMEngine"]

ROOT = Path(__file__).resolve().parents[1]


CONTEXT_MARGIN = 8
"""Positions a served model has beyond ``max_model_len``: SGLang refuses an input longer
than its context length less 6 (``max_req_input_len``), vLLM one that does not fit
``max_model_len`` with its output; so a trace clipped to ``max_model_len`` fits both."""


SCORE_POSITION = 1
"""The position vLLM needs beyond a scored context: it scores a prompt by generating one
token after it, so a whole episode of ``max_model_len`` tokens is refused (HTTP 400)
unless the server has one more."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Counters:
    """One reading of an engine; the counts are since the server started."""

    kv_usage: float
    """Share of the KV pool running requests hold (1.0: full)."""
    preemptions: int
    """Requests preempted (vLLM) or retracted (SGLang) for KV space."""
    prefix_queries: int
    """Prompt tokens looked up in the prefix cache."""
    prefix_hits: int
    """Of those, tokens found."""
    evicted_tokens: int = 0
    """Cached tokens evicted for room (SGLang's ``sglang:evicted_tokens_total``; vLLM
    reports none)."""


KvMeter = Callable[[], Awaitable[float]]
"""Reads an engine's KV use now (share of its pool the running requests hold)."""


class Engine(Protocol):
    """What the bench needs of an engine (see the module docstring)."""

    kind: Literal["vllm", "sglang"]
    unit: str
    """What ``kv`` counts: ``blocks`` or ``tokens``."""
    default_kv: int
    """The pressure run's KV."""
    ample_kv: int
    """The control's KV (as its shadow sees it)."""

    def serve(
        self, model: Path, work: Path, kv: int | None, max_num_seqs: int, max_model_len: int
    ) -> contextlib.AbstractAsyncContextManager[str]:
        """A server on ``model`` with ``kv`` of KV (None: ample); yields its URL."""
        ...

    async def counters(self, url: str) -> Counters: ...

    def kv_meter(self, url: str) -> contextlib.AbstractAsyncContextManager[KvMeter]:
        """One client open for a run's KV polls; yields what reads the KV use."""
        ...

    async def reset_cache(self, url: str) -> None: ...

    def setup(self, url: str, max_num_seqs: int) -> EngineSetup: ...

    def prefix_cache(self, kv: int) -> PrefixCache:
        """The shadow's view of a server with ``kv`` of KV."""
        ...

    def spec(self, profile: EngineProfile, kv: int, max_num_seqs: int) -> RolloutSpec:
        """The simulator's model of the pressure server, fitted to ``profile``."""
        ...

    def server_kv(self, url: str) -> int:
        """The KV of a running server, read from it."""
        ...


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text: str = reply.read().decode()
    return text


def _log_dir(work: Path) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    return work


def _summed(text: str, name: str) -> float:
    """The sum over label sets of the Prometheus sample ``name`` in ``text``."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


class VLLMEngine:
    """vLLM's CPU backend (see the module docstring)."""

    kind: Literal["vllm", "sglang"] = "vllm"
    unit = "blocks"
    default_kv = 16
    ample_kv = 4000
    """1 GiB of the tiny model: ~500k tokens."""
    block = 128
    """vLLM's CPU backend caches whole blocks of 128 tokens."""

    def __init__(self, core: int | None = None) -> None:
        self.core = core
        """The core the server runs on (None: wherever the OS puts it)."""

    @contextlib.asynccontextmanager
    async def serve(
        self, model: Path, work: Path, kv: int | None, max_num_seqs: int, max_model_len: int
    ) -> AsyncIterator[str]:
        config = VLLMServerConfig(
            model=str(model), python=sys.executable, dtype="float32", enforce_eager=True,
            max_model_len=max_model_len + SCORE_POSITION, max_num_seqs=max_num_seqs,
            num_gpu_blocks_override=kv, cpu_kvcache_space_gib=1,
            cpu_omp_threads_bind="nobind", omp_num_threads=1,
            cpus=() if self.core is None else (self.core,),
            env=(("HF_HUB_OFFLINE", "1"),), log_dir=str(work / "logs"), startup_timeout_s=600,
        )  # fmt: skip
        async with VLLMServer(config) as server:
            yield server.url

    async def counters(self, url: str) -> Counters:
        async with VLLMClient(VLLMClientConfig(base_url=url)) as client:
            load = await client.load()
        return Counters(
            kv_usage=load.kv_cache_usage, preemptions=load.num_preemptions,
            prefix_queries=load.prefix_cache_queries, prefix_hits=load.prefix_cache_hits,
        )  # fmt: skip

    @contextlib.asynccontextmanager
    async def kv_meter(self, url: str) -> AsyncIterator[KvMeter]:
        async with VLLMClient(VLLMClientConfig(base_url=url)) as client:

            async def usage() -> float:
                return (await client.load()).kv_cache_usage

            yield usage

    async def reset_cache(self, url: str) -> None:
        async with VLLMClient(VLLMClientConfig(base_url=url)) as client:
            await client.reset_prefix_cache()

    def setup(self, url: str, max_num_seqs: int) -> EngineSetup:
        return EngineSetup(urls={"0": url}, max_num_seqs=max_num_seqs, ignore_eos=True)

    def prefix_cache(self, kv: int) -> PrefixCache:
        return PrefixCache(block_size=self.block, capacity_blocks=kv - 1)

    def spec(self, profile: EngineProfile, kv: int, max_num_seqs: int) -> RolloutSpec:
        """vLLM keeps one of its KV blocks as the null block; it reserves nothing for
        future tokens (blocks are allocated as decoding goes) and preempts the newest
        running request when a step finds no free block (modelled as a retraction freeing
        a few steps of headroom); its prefix cache serves whole blocks only, siblings share
        a cached prompt's blocks while they run, and a freed sequence's blocks are evicted
        last first (``shared_prefix``)."""
        base = RolloutSpec(
            tp=1, kv_capacity_tokens=(kv - 1) * self.block, max_running_requests=max_num_seqs,
            step_fixed_s=1.0, step_per_seq_s=0.0, step_per_kv_token_s=0.0,
            prefill_tokens_per_s=1.0, new_token_ratio=0.0, min_new_token_ratio=0.0,
            retract_decode_steps=8, cache_block_tokens=self.block, shared_prefix=True,
        )  # fmt: skip
        return profile.fit(base)

    def server_kv(self, url: str) -> int:
        """``num_gpu_blocks`` from ``vllm:cache_config_info``; SystemExit unless its blocks
        are 128 tokens (the bench models vLLM's CPU backend)."""
        text = _metrics(url)
        info = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.MULTILINE)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1))) if info else {}
        if labels.get("block_size") != str(self.block) or not labels.get("num_gpu_blocks"):
            raise SystemExit(f"{url}: blocks of {self.block} tokens expected, found {labels}")
        return int(labels["num_gpu_blocks"])


class SGLangEngine:
    """SGLang 0.5.23 on CPU, from ``.venv-sglang`` (see the module docstring)."""

    kind: Literal["vllm", "sglang"] = "sglang"
    unit = "tokens"
    default_kv = 2048
    ample_kv = 500_000
    init_new_token_ratio = 0.7
    """SGLang's ``SGLANG_INIT_NEW_TOKEN_RATIO``."""
    min_new_token_ratio = 0.7 * 0.14
    """``SGLANG_INIT_NEW_TOKEN_RATIO × SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR``."""
    decay_steps = 600
    """``SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS``."""
    retract_decode_steps = 20
    """``SGLANG_RETRACT_DECODE_STEPS``."""

    def __init__(self, core: int = 0, venv: Path | None = None) -> None:
        self.python = (venv or ROOT / ".venv-sglang") / "bin" / "python"
        self.core = core

    @contextlib.asynccontextmanager
    async def serve(
        self, model: Path, work: Path, kv: int | None, max_num_seqs: int, max_model_len: int
    ) -> AsyncIterator[str]:
        if not self.python.exists():
            raise SystemExit(f"no SGLang environment at {self.python}: run `make sglang-env`")
        config = SGLangServerConfig(
            model_path=str(model), python=str(self.python), enable_memory_saver=False,
            enable_priority_scheduling=False,
            extra_args=(
                "--device", "cpu", "--attention-backend", "torch_native",
                "--sampling-backend", "pytorch", "--mem-fraction-static", "0.05",
                "--max-running-requests", str(max_num_seqs),
                "--max-total-tokens", str(kv or self.ample_kv),
                "--context-length", str(max_model_len + CONTEXT_MARGIN),
                "--schedule-policy", "fcfs", "--enable-metrics", "--skip-server-warmup",
            ),
            env=(
                ("SGLANG_USE_CPU_ENGINE", "1"), ("HF_HUB_OFFLINE", "1"),
                ("OMP_NUM_THREADS", "1"), ("SGLANG_CPU_OMP_THREADS_BIND", str(self.core)),
            ),
            log_path=str(_log_dir(work) / "sglang.log"), startup_timeout_s=600.0,
        )  # fmt: skip
        async with SGLangServer(config) as server:
            yield server.url

    async def counters(self, url: str) -> Counters:
        async with SGLangClient(ClientConfig(base_url=url)) as client:
            loads = await client.loads()
        text = await asyncio.to_thread(_metrics, url)
        return Counters(
            kv_usage=max((load.token_usage for load in loads.loads), default=0.0),
            preemptions=int(_summed(text, "sglang:num_retracted_requests_total")),
            prefix_queries=int(_summed(text, "sglang:prompt_tokens_total")),
            prefix_hits=int(_summed(text, "sglang:cached_tokens_total")),
            evicted_tokens=int(_summed(text, "sglang:evicted_tokens_total")),
        )

    @contextlib.asynccontextmanager
    async def kv_meter(self, url: str) -> AsyncIterator[KvMeter]:
        async with SGLangClient(ClientConfig(base_url=url)) as client:

            async def usage() -> float:
                loads = await client.loads()
                return max((load.token_usage for load in loads.loads), default=0.0)

            yield usage

    async def reset_cache(self, url: str) -> None:
        async with SGLangClient(ClientConfig(base_url=url)) as client:
            await client.flush_cache(timeout_s=30.0)

    def setup(self, url: str, max_num_seqs: int) -> EngineSetup:
        return EngineSetup(
            kind="sglang", urls={"0": url}, max_num_seqs=max_num_seqs, ignore_eos=True
        )

    prefill_batch_s = 0.01
    """Requests sent within this long of a batch's first share its prefill batch: about
    one engine step here (a decode step of 8 requests took 6–12 ms)."""

    def prefix_cache(self, kv: int) -> PrefixCache:
        """Token-granular, a prompt cached when its prefill batch ends (measured:
        ``tests/engines/test_agent_replay.py``)."""
        return PrefixCache(block_size=1, capacity_blocks=kv, prefill_batch_s=self.prefill_batch_s)

    def spec(self, profile: EngineProfile, kv: int, max_num_seqs: int) -> RolloutSpec:
        """SGLang's admission as configured: the KV in tokens, a reserve of
        ``new_token_ratio`` of running requests' future tokens decaying from 0.7 to 0.098
        over 600 steps, a retraction freeing 20 steps of headroom, a token-granular radix
        cache whose nodes siblings share while they run and whose leaves are evicted first
        (``shared_prefix``), a prompt inserted into it when its prefill batch ends
        (``prefix_cached_after_prefill``: siblings admitted together each compute it)."""
        base = RolloutSpec(
            tp=1, kv_capacity_tokens=kv, max_running_requests=max_num_seqs,
            step_fixed_s=1.0, step_per_seq_s=0.0, step_per_kv_token_s=0.0,
            prefill_tokens_per_s=1.0, new_token_ratio=self.init_new_token_ratio,
            min_new_token_ratio=self.min_new_token_ratio,
            new_token_ratio_decay_steps=self.decay_steps,
            retract_decode_steps=self.retract_decode_steps, cache_block_tokens=1,
            shared_prefix=True, prefix_cached_after_prefill=True,
        )  # fmt: skip
        return profile.fit(base)

    def server_kv(self, url: str) -> int:
        """``max_total_num_tokens`` from ``/v1/loads``."""
        with urllib.request.urlopen(f"{url}/v1/loads", timeout=30) as reply:
            text = reply.read().decode()
        found = re.search(r'"max_total_num_tokens":\s*(\d+)', text)
        if not found:
            raise SystemExit(f"{url}: no max_total_num_tokens in /v1/loads")
        return int(found.group(1))


ENGINES: dict[str, type[VLLMEngine] | type[SGLangEngine]] = {
    "vllm": VLLMEngine,
    "sglang": SGLangEngine,
}
