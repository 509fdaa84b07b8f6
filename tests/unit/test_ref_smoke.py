"""The single-process GRPO job: reward moves, manifests and checksums are recorded."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator

import pytest
import torch

from dynarl.backends.reference import (
    CharTokenizer,
    EngineConfig,
    GPTConfig,
    ReferenceSetup,
    RolloutConfig,
    RolloutEngine,
    ToolCalcTask,
    ToolLatency,
    ToolWorker,
    collect_rollouts,
    warm_start,
)
from dynarl.demo._smoke import SmokeConfig, run_grpo

# Megatron on gloo leaves a listening socket in native code (see tests/conftest.py).
pytestmark = pytest.mark.gloo_listener_outlives_test


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread, the runtime's device model (and much faster on a busy box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow  # ~25 s of training; make demo shows the reward rising too
def test_grpo_raises_the_reward_on_the_chain_sum_task() -> None:
    config = SmokeConfig()  # 50 supervised warm-up steps, then 12 GRPO steps
    result = run_grpo(config)
    rewards = [record.mean_reward for record in result.records]
    assert len(rewards) == config.num_steps
    assert statistics.mean(rewards[-3:]) >= statistics.mean(rewards[:3]) + 0.05, rewards
    assert result.sft_losses[-1] < 0.5 * result.sft_losses[0]
    expected = config.num_prompts * config.rollout.group_size
    checksums = set()
    for record in result.records:
        assert len(set(record.manifest)) == len(record.manifest) == expected
        assert list(record.manifest) == sorted(record.manifest)
        assert len(record.rewards) == expected
        checksums.add(record.checksum)
    assert len(checksums) == config.num_steps
    assert result.prefix_hit_tokens > 0  # samples of a group share their prompt's KV


def test_multi_turn_episodes_call_the_calculator() -> None:
    result = run_grpo(
        SmokeConfig(
            task="tool_calc",
            num_steps=2,
            num_prompts=4,
            sft_steps=40,
            rollout=RolloutConfig(group_size=4, max_response_tokens=120),
        )
    )
    calls = [record.tool_calls / 16 for record in result.records]
    assert min(calls) >= 2.0, calls  # several calls per episode on average


@pytest.mark.parametrize("latency", [0.0, 0.001])
def test_rollout_masks_tool_results_and_records_provenance(latency: float) -> None:
    model = GPTConfig(max_seq_len=160)
    task, tokenizer = ToolCalcTask(seed=1), CharTokenizer()
    # A short supervised warm-up (the job's Megatron trainer), so that the policy writes
    # tool calls at all.
    setup = ReferenceSetup(model=model, task="tool_calc", engine=EngineConfig(max_seq_len=160))
    weights = warm_start(setup, num_steps=30, batch_size=16, lr=2e-3)
    engine = RolloutEngine(model, EngineConfig(max_seq_len=160))
    engine.load_weights(weights, version=3)
    problems = task.problems(step=0, num_problems=2)
    tool = ToolWorker(latency=ToolLatency(median_s=latency, sigma=0.0, max_s=0.01))
    samples = asyncio.run(
        collect_rollouts(
            engine, task, tokenizer, problems, RolloutConfig(group_size=3, seed=4), tool=tool
        )
    )
    assert [s.sample_id for s in samples] == sorted(s.sample_id for s in samples)
    assert len(samples) == 6
    for sample in samples:
        n = len(sample.response_tokens)
        assert len(sample.policy_mask) == len(sample.logprobs) == len(sample.versions) == n
        for keep, version, logprob in zip(
            sample.policy_mask, sample.versions, sample.logprobs, strict=True
        ):
            assert (version == 3 and logprob <= 0) if keep else (version == -1 and logprob == 0)
        train = sample.train_sample(0.5)
        assert len(train.loss_mask) == len(sample.tokens) - 1
        assert sum(train.loss_mask) == sum(sample.policy_mask)
        assert sample.reward in (0.0, 1.0)
    assert tool.num_calls == sum(s.num_tool_calls for s in samples) > 0
    assert any(not keep for s in samples for keep in s.policy_mask)


@pytest.mark.slow
def test_the_whole_job_is_reproducible_bit_for_bit() -> None:
    config = SmokeConfig(num_steps=4, sft_steps=20)
    first, second = run_grpo(config), run_grpo(config)
    for a, b in zip(first.records, second.records, strict=True):
        assert (a.manifest, a.rewards, a.checksum, a.loss) == (
            b.manifest,
            b.rewards,
            b.checksum,
            b.loss,
        )
