"""A multi-turn agentic trace replayed through a job on the shared real vLLM server: one
group of two episodes, each turn exactly its traced length, later turns finding their
episode's earlier context in the engine's prefix cache (whole 128-token blocks on vLLM's
CPU backend), the records consistent with the trace. Then the smoke of
``bench/priority.py`` itself: its ``main`` on the same server with one episode, one round
and the quickest profile, its last line checked for every figure it promises."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_support import MAX_NUM_SEQS

from dynarl.backends.serving import EngineRollout, EngineSetup
from dynarl.backends.vllm import VLLMClient, VLLMClientConfig, VLLMServer
from dynarl.demo._agent_replay import replay_trace
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import FifoPolicy, SchedulerConfig
from dynarl.sim import AgenticSpec, BatchSpec, LengthSpec, agentic_trace

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


def test_the_priority_bench_runs_one_episode_on_the_shared_server(
    vllm_server: VLLMServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports its sibling _vllm_profile
    spec = importlib.util.spec_from_file_location("bench_priority", BENCH / "priority.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look it up there
    spec.loader.exec_module(bench)
    max_model_len = vllm_server.config.max_model_len
    assert max_model_len is not None
    argv = [
        "--url", vllm_server.url, "--episodes", "1", "--reps", "1", "--seed", "1",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(max_model_len),
        "--quick-profile",
    ]  # fmt: skip
    assert bench.main(argv) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
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
