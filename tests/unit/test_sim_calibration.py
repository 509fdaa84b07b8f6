"""The simulator's engine model calibrated from a profiling pass, and its replay prediction
(the real engine's profile and the comparison run in bench/priority.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynarl.errors import DynarlError
from dynarl.sched import FifoPolicy, PriorityPolicy, ToolMlfqPolicy
from dynarl.sim import (
    AgenticSpec,
    BatchSpec,
    DecodePoint,
    EngineProfile,
    LengthSpec,
    PrefillPoint,
    RolloutSpec,
    agentic_trace,
    load_workload,
    replay_rollout,
    spec_digest,
)

ROOT = Path(__file__).resolve().parents[2]
BASE = RolloutSpec(
    tp=1, kv_capacity_tokens=1920, max_running_requests=8, step_fixed_s=1.0,
    step_per_seq_s=0.0, step_per_kv_token_s=0.0, prefill_tokens_per_s=1.0,
    new_token_ratio=0.0, min_new_token_ratio=0.0, retract_decode_steps=8,
)  # fmt: skip
POINTS = [(b, kv) for b in (1, 2, 4, 8) for kv in (100.0, 900.0)]


def profile(t0: float, c_seq: float, c_kv: float, speed: float) -> EngineProfile:
    decode = tuple(
        DecodePoint(batch=b, kv_tokens=b * kv, step_s=t0 + c_seq * b + c_kv * b * kv)
        for b, kv in POINTS
    )
    prefill = tuple(PrefillPoint(tokens=n, seconds=0.002 + n / speed) for n in (112, 752, 1264))
    return EngineProfile(decode=decode, prefill=prefill)


@given(st.floats(1e-4, 1e-1), st.floats(0.0, 1e-3), st.floats(0.0, 1e-5), st.floats(1e3, 1e6))
def test_the_fit_recovers_the_step_curve_and_prefill_speed_it_was_measured_from(
    t0: float, c_seq: float, c_kv: float, speed: float
) -> None:
    spec = profile(t0, c_seq, c_kv, speed).fit(BASE)
    assert spec.step_fixed_s == pytest.approx(t0, rel=1e-6, abs=1e-9)
    assert spec.step_per_seq_s == pytest.approx(c_seq, rel=1e-6, abs=1e-9)
    assert spec.step_per_kv_token_s == pytest.approx(c_kv, rel=1e-6, abs=1e-11)
    assert spec.prefill_tokens_per_s == pytest.approx(speed, rel=1e-6)
    assert dataclasses.replace(spec, **_speeds(BASE)) == BASE  # the configuration is kept


def _speeds(spec: RolloutSpec) -> dict[str, float]:
    names = ("step_fixed_s", "step_per_seq_s", "step_per_kv_token_s", "prefill_tokens_per_s")
    return {name: getattr(spec, name) for name in names}


def test_a_coefficient_the_data_drives_negative_is_dropped_and_the_rest_refitted() -> None:
    decode = tuple(
        DecodePoint(batch=b, kv_tokens=b * kv, step_s=0.01 + 0.002 * b - 1e-6 * b * kv)
        for b, kv in POINTS
    )
    prefill = (PrefillPoint(tokens=100, seconds=0.01), PrefillPoint(tokens=900, seconds=0.05))
    t0, c_seq, c_kv = EngineProfile(decode=decode, prefill=prefill).step_coefficients()
    assert c_kv == 0.0 and t0 > 0 and c_seq >= 0
    with pytest.raises(ValueError, match="decode points"):
        EngineProfile(decode=decode[:2], prefill=prefill)
    with pytest.raises(ValueError, match="prefill points"):
        EngineProfile(decode=decode, prefill=prefill[:1])
    flat = (PrefillPoint(tokens=100, seconds=0.05), PrefillPoint(tokens=900, seconds=0.01))
    with pytest.raises(ValueError, match="do not grow"):
        EngineProfile(decode=decode, prefill=flat).prefill_tokens_per_s()


def test_the_digest_names_every_field() -> None:
    assert spec_digest(BASE) == spec_digest(dataclasses.replace(BASE))
    for change in (
        {"step_per_seq_s": 1e-9},
        {"cache_block_tokens": 128},
        {"kv_capacity_tokens": 1921},
    ):
        assert spec_digest(dataclasses.replace(BASE, **change)) != spec_digest(BASE)


TRACE = agentic_trace(
    seed=0, tool_success_rate=0.7,
    batch=BatchSpec(num_prompts=4, group_size=4, num_minibatches=1, max_seq_len=1536),
    lengths=LengthSpec(prompt_median=300, prompt_sigma=0.3, output_median=64, output_sigma=0.5),
    agentic=AgenticSpec(
        mean_tool_calls=3.0, max_tool_calls=6, turn_decay=0.8, tool_latency_median_s=0.3,
        tool_latency_sigma=1.0, tool_timeout_s=5.0, observation_median=150,
        observation_sigma=0.4,
    ),
)  # fmt: skip


def workload(**rollout: object) -> object:
    base = load_workload(ROOT / "examples" / "workloads" / "agentic-7b-64gpu.toml")
    spec = dataclasses.replace(
        profile(0.004, 1e-4, 2e-7, 20000.0).fit(BASE),
        **rollout,  # type: ignore[arg-type]
    )
    return dataclasses.replace(
        base, rollout=spec, batch=dataclasses.replace(base.batch, max_seq_len=1536)
    )


def test_a_replay_prediction_is_deterministic_and_block_reuse_hits_less() -> None:
    ample = workload(kv_capacity_tokens=400_000)
    tokens = replay_rollout(ample, TRACE, FifoPolicy())  # type: ignore[arg-type]
    assert tokens == replay_rollout(ample, TRACE, FifoPolicy())  # type: ignore[arg-type]
    assert tokens.hit_rate > 0.5 and tokens.reprefill_tokens == 0 and tokens.retractions == 0
    blocks = replay_rollout(
        workload(kv_capacity_tokens=400_000, cache_block_tokens=128),  # type: ignore[arg-type]
        TRACE,
        FifoPolicy(),
    )
    assert blocks.hit_rate < tokens.hit_rate  # partial blocks are prefilled again
    assert blocks.prefill_tokens > tokens.prefill_tokens
    tight = replay_rollout(workload(), TRACE, FifoPolicy())  # type: ignore[arg-type]
    assert tight.iteration_s > tokens.iteration_s and tight.reprefill_tokens > 0
    assert tight.hit_rate < tokens.hit_rate


def test_every_request_policy_finishes_the_trace_and_a_stuck_one_is_reported() -> None:
    w = workload()
    for policy in (FifoPolicy(), PriorityPolicy(), ToolMlfqPolicy(quantum=64.0, levels=4)):
        assert replay_rollout(w, TRACE, policy).iteration_s > 0  # type: ignore[arg-type]
    with pytest.raises(DynarlError, match="exceeded 10 events"):
        replay_rollout(w, TRACE, FifoPolicy(), max_events=10)  # type: ignore[arg-type]


def test_a_round_trip_per_turn_delays_each_episode_by_its_turns() -> None:
    one = dataclasses.replace(
        TRACE, **{name: getattr(TRACE, name)[:1] for name in ("prompt", "group")},
        turn_start=TRACE.turn_start[:2],
    )  # fmt: skip
    base = workload(kv_capacity_tokens=400_000)
    trip = 0.25
    slow = dataclasses.replace(
        base,  # type: ignore[type-var]
        rollout=dataclasses.replace(base.rollout, request_overhead_s=trip),  # type: ignore[attr-defined]
    )
    fast = replay_rollout(base, one, FifoPolicy())  # type: ignore[arg-type]
    delayed = replay_rollout(slow, one, FifoPolicy())  # type: ignore[arg-type]
    turns = int(one.num_turns[0])
    assert turns > 1
    assert delayed.iteration_s == pytest.approx(fast.iteration_s + trip * turns, abs=1e-6)
    assert (
        replay_rollout(slow, TRACE, FifoPolicy()).iteration_s
        > replay_rollout(  # type: ignore[arg-type]
            base,
            TRACE,
            FifoPolicy(),  # type: ignore[arg-type]
        ).iteration_s
    )
    points = profile(0.004, 1e-4, 2e-7, 20000.0)
    measured = dataclasses.replace(points, round_trip_s=0.0041 + 1e-4 + 0.3)
    assert measured.fit(BASE).request_overhead_s == pytest.approx(0.3, abs=1e-3)
    with pytest.raises(ValueError, match="round_trip_s"):
        dataclasses.replace(points, round_trip_s=-1.0)
