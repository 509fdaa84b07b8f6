"""The agentic trace's tool outcomes and the replay's figures (the real-engine replay runs in
tests/engines/test_agent_replay.py)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynarl.demo._agent_replay import ReplayReport, TurnRecord, turn_tokens
from dynarl.sim import AgenticSpec, BatchSpec, LengthSpec, agentic_trace

BATCH = BatchSpec(num_prompts=8, group_size=4, num_minibatches=1, max_seq_len=4096)
LENGTHS = LengthSpec(prompt_median=300, prompt_sigma=0.3, output_median=64, output_sigma=0.5)
AGENTIC = AgenticSpec(
    mean_tool_calls=3.0, max_tool_calls=6, turn_decay=0.8, tool_latency_median_s=0.3,
    tool_latency_sigma=1.0, tool_timeout_s=5.0, observation_median=150, observation_sigma=0.4,
)  # fmt: skip


def trace(rate: float, seed: int = 0, iteration: int = 0) -> Any:
    return agentic_trace(
        seed=seed, batch=BATCH, lengths=LENGTHS, agentic=AGENTIC, iteration=iteration,
        tool_success_rate=rate,
    )  # fmt: skip


@given(st.floats(0.0, 0.99), st.integers(0, 2**16), st.integers(0, 5))
def test_tool_outcomes_are_drawn_apart_from_everything_else(
    rate: float, seed: int, iteration: int
) -> None:
    always, sometimes = trace(1.0, seed, iteration), trace(rate, seed, iteration)
    assert always.tool_ok is None
    for name in ("prompt", "group", "turn_start", "output", "tool_latency", "observation"):
        assert np.array_equal(getattr(always, name), getattr(sometimes, name)), name
    ok = sometimes.tool_ok
    assert ok is not None and ok.shape == sometimes.output.shape
    last = sometimes.turn_start[1:] - 1
    assert ok[last].all()  # no tool call after an episode's last turn, so nothing failed
    again = trace(rate, seed, iteration).tool_ok
    assert np.array_equal(ok, again)


def test_the_success_rate_is_the_share_of_successful_calls() -> None:
    many = dataclasses.replace(BATCH, num_prompts=256)
    t = agentic_trace(seed=1, batch=many, lengths=LENGTHS, agentic=AGENTIC, tool_success_rate=0.7)
    calls = np.ones(t.output.shape, dtype=bool)
    calls[t.turn_start[1:] - 1] = False
    assert t.tool_ok is not None
    assert abs(t.tool_ok[calls].mean() - 0.7) < 0.03


def test_a_success_rate_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError, match="tool_success_rate"):
        trace(1.5)


def record(sample: int, turn: int, prompt: int, reusable: int, cached: int) -> TurnRecord:
    return TurnRecord(
        sample=sample, turn=turn, prompt_tokens=prompt, reusable=reusable, cached_tokens=cached,
        output_tokens=10, submitted_s=float(turn), finished_s=turn + 0.5, device=0,
    )  # fmt: skip


def test_the_replays_figures() -> None:
    report = ReplayReport(
        wall_s=3.0,
        turns=(record(0, 0, 300, 0, 0), record(0, 1, 460, 310, 256), record(1, 1, 460, 310, 0)),
    )
    assert report.hit_rate == pytest.approx(256 / 1220)
    assert report.reprefill_tokens == (310 - 256) + 310
    assert report.waits_s == (0.5, 0.5, 0.5)


@given(st.integers(0, 100), st.integers(0, 1), st.integers(0, 1000), st.integers(0, 400))
def test_turn_tokens_are_seeded_and_in_the_vocabulary(
    seed: int, kind: int, index: int, length: int
) -> None:
    tokens = turn_tokens(seed, kind, index, length, 380)
    assert len(tokens) == length and all(0 <= t < 380 for t in tokens)
    assert tokens == turn_tokens(seed, kind, index, length, 380)


spans = st.lists(
    st.tuples(st.floats(0, 100), st.floats(0, 10)).map(lambda p: (p[0], p[0] + p[1])),
    max_size=12,
)


@given(spans)
def test_the_scorers_busy_time_is_the_union_of_its_spans(
    score_spans: list[tuple[float, float]],
) -> None:
    busy = ReplayReport(wall_s=1.0, turns=(), score_spans=tuple(score_spans)).score_busy_s
    # The union, measured another way: on a fine grid of the spans' own end points.
    points = sorted({x for span in score_spans for x in span})
    covered = sum(
        b - a
        for a, b in itertools.pairwise(points)
        if any(start <= a and b <= stop for start, stop in score_spans)
    )
    assert busy == pytest.approx(covered, abs=1e-9)
    assert busy <= sum(stop - start for start, stop in score_spans) + 1e-9
