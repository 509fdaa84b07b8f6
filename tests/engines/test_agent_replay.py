"""A multi-turn agentic trace replayed through a job on the shared real vLLM server: one
group of two episodes, each turn exactly its traced length, later turns finding their
episode's earlier context in the engine's prefix cache (whole 128-token blocks on vLLM's
CPU backend), the records consistent with the trace. Then the smoke of
``bench/priority.py`` itself: its ``main`` on the same server with one episode, one round
and the quickest profile, its last line checked for every figure it promises; and the same
smoke on the shared real SGLang server where there is one (``make test-sglang``)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from vllm_support import MAX_NUM_SEQS

from dynarl.backends.serving import EngineRollout, EngineSetup
from dynarl.backends.vllm import VLLMClient, VLLMClientConfig, VLLMServer
from dynarl.demo._agent_replay import replay_trace
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import FifoPolicy, SchedulerConfig
from dynarl.sim import AgenticSpec, BatchSpec, LengthSpec, agentic_trace

from .sglang_support import CONTEXT_LENGTH as SGLANG_CONTEXT
from .sglang_support import MAX_RUNNING as SGLANG_MAX_RUNNING
from .sglang_support import MAX_TOTAL_TOKENS as SGLANG_KV
from .sglang_targets import Target

pytestmark = pytest.mark.engines

BENCH = Path(__file__).resolve().parents[2] / "bench"

TRACE = agentic_trace(
    seed=3,
    batch=BatchSpec(num_prompts=1, group_size=2, num_minibatches=1, max_seq_len=1024),
    lengths=LengthSpec(prompt_median=200, prompt_sigma=0.0, output_median=16, output_sigma=0.0),
    agentic=AgenticSpec(
        mean_tool_calls=2.0, max_tool_calls=2, turn_decay=1.0, tool_latency_median_s=0.05,
        tool_latency_sigma=0.0, tool_timeout_s=1.0, observation_median=60,
        observation_sigma=0.0,
    ),
)  # fmt: skip


def test_an_agentic_trace_replays_turn_by_turn_with_its_prefix_cached(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    setup = EngineSetup(urls={"0": vllm_server.url}, max_num_seqs=MAX_NUM_SEQS, ignore_eos=True)
    spec = ComponentSpec(
        role=EngineRollout, devices=(0,), options=setup.to_options(),
        max_inflight=MAX_NUM_SEQS, request_policy=FifoPolicy(),
    )  # fmt: skip
    runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True))
    config = JobConfig(num_devices=1, run_dir=str(tmp_path / "run"), runtime=runtime)

    async def main() -> Any:
        async with VLLMClient(VLLMClientConfig(base_url=vllm_server.url)) as client:
            await client.reset_prefix_cache()
        async with asyncio.timeout(300), Job([spec], config) as job:
            return await replay_trace(job, TRACE, vocab=380)

    report = asyncio.run(main())
    turns = report.turns
    assert len(turns) == int(TRACE.turn_start[-1])
    by_episode = {
        s: sorted((t for t in turns if t.sample == s), key=lambda t: t.turn) for s in (0, 1)
    }
    for s, episode in by_episode.items():
        start = int(TRACE.turn_start[s])
        traced = [int(x) for x in TRACE.output[start : int(TRACE.turn_start[s + 1])]]
        assert [t.turn for t in episode] == list(range(len(traced)))
        assert [t.output_tokens for t in episode] == traced
        first, *later = episode
        assert first.reusable == 0 and first.prompt_tokens == int(TRACE.prompt[s])
        for before, turn in zip(episode, later, strict=False):
            # the context grew by the turn's output and the tool's observation
            assert turn.reusable == before.prompt_tokens + before.output_tokens
            assert turn.prompt_tokens == turn.reusable + int(TRACE.observation[start + before.turn])
            assert turn.cached_tokens >= 128  # its earlier context, in whole blocks
            assert turn.submitted_s >= before.finished_s
    assert 0.0 < report.hit_rate < 1.0
    # re-prefilled: the tail of each earlier context that fills no whole 128-token block
    assert 0 < report.reprefill_tokens < sum(t.reusable for t in turns)


def run_bench(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> dict[str, Any]:
    """``bench/priority.py``'s ``main`` on ``argv``, asked to succeed; its last line."""
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports its sibling modules
    spec = importlib.util.spec_from_file_location("bench_priority", BENCH / "priority.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look it up there
    spec.loader.exec_module(bench)
    assert bench.main(argv) == 0
    figures: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return figures


def check_one_episode(figures: dict[str, Any], engine: str) -> None:
    """Every figure the bench promises, for one episode in one round on ample KV."""
    assert figures["engine"] == engine
    assert figures["episodes"] == 1 and figures["reps"] == 1
    bound = figures["max_overtakes_bound"]
    assert set(figures["policies"]) == {"fifo", "fifo-aa", "dynarl", "plas", "cmlfq"}
    for policy in figures["policies"].values():
        assert policy["iteration_s"] > 0
        assert 0.0 <= policy["hit_rate"] <= 1.0 and policy["reprefill_tokens"] >= 0
        assert 0 <= policy["max_overtakes"] <= bound
        # one episode on ample KV: the shadow of the engine's cache is exact
        assert policy["shadow_exact"] == 1.0 and policy["shadow_error"] == 0
    assert figures["control"]["hit_rate"] > 0  # its second turn found the first's context
    assert figures["overtakes_within_bound"] is True
    assert figures["aa_noise"] >= 0
    for key in ("priority_gain_over_fifo", "sim_gain_error"):
        assert math.isfinite(figures[key])
    assert figures["priority_gain_over_fifo"] > -1
    assert len(figures["sim"]["model_digest"]) == 16


def test_the_priority_bench_runs_one_episode_on_the_shared_server(
    vllm_server: VLLMServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    max_model_len = vllm_server.config.max_model_len
    assert max_model_len is not None
    argv = [
        "--url", vllm_server.url, "--episodes", "1", "--reps", "1", "--seed", "1",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(max_model_len),
        "--quick-profile",
    ]  # fmt: skip
    check_one_episode(run_bench(argv, monkeypatch, capsys), "vllm")


def test_the_priority_bench_runs_one_episode_on_a_real_sglang_server(
    real_target: Target, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same smoke on the shared real SGLang server (``make test-sglang``; skipped, with
    the reason, where there is no SGLang environment)."""
    argv = [
        "--engine", "sglang", "--url", real_target.url, "--episodes", "1", "--reps", "1",
        "--seed", "1", "--max-num-seqs", str(SGLANG_MAX_RUNNING),
        "--max-model-len", str(SGLANG_CONTEXT), "--quick-profile",
    ]  # fmt: skip
    figures = run_bench(argv, monkeypatch, capsys)
    check_one_episode(figures, "sglang")
    assert figures["kv_unit"] == "tokens" and figures["kv"] == SGLANG_KV


def test_sglang_caches_a_prompt_after_the_prefill_batch_that_computed_it(
    real_target: Target,
) -> None:
    """The engine fact behind the simulator's ``prefix_cached_after_prefill``: siblings
    SGLang prefills in one batch each compute their shared prompt; a later one reuses it."""

    async def main() -> tuple[list[int], list[int]]:
        async with aiohttp.ClientSession() as http:

            async def cached(prompt: list[int]) -> int:
                body = {
                    "input_ids": prompt,
                    "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0},
                }
                async with http.post(f"{real_target.url}/generate", json=body) as reply:
                    reply.raise_for_status()
                    found: int = (await reply.json())["meta_info"]["cached_tokens"]
                    return found

            async def flush() -> None:
                async with http.post(f"{real_target.url}/flush_cache") as reply:
                    reply.raise_for_status()

            await flush()
            shared = [(11 + i) % 380 for i in range(200)]
            together = await asyncio.gather(*(cached([*shared, k]) for k in range(2)))
            await flush()
            shared = [(23 + i) % 380 for i in range(200)]
            apart = [await cached([*shared, k]) for k in range(2)]
            await flush()
            return list(together), apart

    together, apart = asyncio.run(main())
    assert together == [0, 0]  # one prefill batch: neither found the other's prompt
    assert apart == [0, 200]
