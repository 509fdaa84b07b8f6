"""The vLLM demo's judgement of its runs, built by hand (the real job runs in
tests/engines/test_engine_demo.py): medians over repetitions, every ratio, and the checks
that replace bitwise equality on a batching engine; the seed each request gets; refusals."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from test_demo import run

from dynarl.backends.serving import request_seed
from dynarl.bus import Sample, pack_floats, pack_tokens
from dynarl.cli import main
from dynarl.demo._device_schedules import RunPlan, Schedule
from dynarl.demo._engine_cli import format_engine_summary
from dynarl.demo._engine_demo import EngineComparison, EngineDemoConfig, compare_repetitions
from dynarl.demo._experiment import ExperimentConfig, RunResult
from dynarl.runtime import VERSIONS, encode_versions, stale_tokens

DYNARL = RunPlan(schedule=Schedule.DYNARL)
SEQUENTIAL = RunPlan(schedule=Schedule.SEQUENTIAL)
SPLIT = RunPlan(schedule=Schedule.SPLIT)


def repetitions(
    tmp: Path, walls: dict[str, list[float]], **steps: object
) -> dict[str, list[RunResult]]:
    plans = {"dynarl": DYNARL, "sequential": SEQUENTIAL, "split-1/1": SPLIT}
    tmp.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[RunResult]] = {}
    for label, values in walls.items():
        out[label] = []
        for i, wall in enumerate(values):
            result = run(f"{label}-{i}", plans[label], wall, tmp)
            out[label].append(
                replace(result, label=label, steps=tuple(replace(s, **steps) for s in result.steps))  # type: ignore[arg-type]
            )
    return out


def judge(runs: dict[str, list[RunResult]], *, replay: bool = True) -> EngineComparison:
    return compare_repetitions(runs, dynarl="dynarl", sequential="sequential", replay_equal=replay)


def test_medians_and_every_repetitions_ratio(tmp_path: Path) -> None:
    runs = repetitions(
        tmp_path,
        {
            "sequential": [12.0, 10.0, 30.0],
            "split-1/1": [9.0, 11.0, 10.0],
            "dynarl": [8.0, 10.0, 9.0],
        },
        stale_tokens=0,
        logprob_gap=2e-5,
    )
    c = judge(runs)
    assert c.medians == {"sequential": 12.0, "split-1/1": 10.0, "dynarl": 9.0}
    assert c.speedup_vs_static == pytest.approx(12.0 / 9.0)  # the median, not the mean
    assert c.speedup_vs_best_split == pytest.approx(10.0 / 9.0)
    assert c.best_split == "split-1/1"
    assert c.ratios["sequential"] == pytest.approx((1.5, 1.0, 30.0 / 9.0))
    assert "dynarl" not in c.ratios
    assert c.manifests_equal and c.versions_as_expected and c.replay_checksums_equal
    assert c.logprob_max_abs_diff == pytest.approx(2e-5)
    figures = c.to_json()
    assert figures["walls_s"]["sequential"] == [12.0, 10.0, 30.0]
    text = format_engine_summary(c, run_dir=tmp_path)
    assert "medians of 3): **1.33×**" in text
    assert "1.50×, 1.00×, 3.33×" in text
    assert "bitwise at every step: **yes**" in text


def test_a_stale_token_a_failed_replay_and_a_different_manifest_each_fail(tmp_path: Path) -> None:
    walls = {"sequential": [10.0], "split-1/1": [9.0], "dynarl": [8.0]}
    stale = repetitions(tmp_path / "a", walls, stale_tokens=3)
    c = judge(stale, replay=False)
    assert not c.versions_as_expected and c.stale_tokens == 3 * 2 * 3  # 3 per step, 2 steps, 3 runs
    assert not c.replay_checksums_equal
    assert math.isnan(c.logprob_max_abs_diff)  # no gap measured
    text = format_engine_summary(c, run_dir=tmp_path)
    assert "expects: **NO** (18 other)" in text and "every step: **NO**" in text
    other = repetitions(tmp_path / "b", walls)
    other["dynarl"][0] = replace(
        other["dynarl"][0],
        steps=tuple(replace(s, manifest=("2", "1")) for s in other["dynarl"][0].steps),
    )
    assert not judge(other).manifests_equal


def test_unequal_repetitions_or_no_split_are_refused(tmp_path: Path) -> None:
    runs = repetitions(
        tmp_path / "a", {"sequential": [10.0, 11.0], "split-1/1": [9.0], "dynarl": [8.0]}
    )
    with pytest.raises(ValueError, match="same number of runs"):
        judge(runs)
    runs = repetitions(tmp_path / "b", {"sequential": [10.0], "dynarl": [8.0]})
    with pytest.raises(ValueError, match="at least one static split"):
        judge(runs)


def sample(versions: list[int], generated: int) -> Sample:
    return Sample(
        sample_id="s",
        token_ids=pack_tokens(list(range(2 + generated))),
        prompt_len=2,
        logprobs=pack_floats([-0.5] * generated),
        metadata={VERSIONS: encode_versions(versions)},
    )


@given(st.lists(st.integers(0, 3), max_size=12), st.integers(0, 3))
def test_stale_tokens_counts_other_versions_and_missing_ones(
    versions: list[int], expected: int
) -> None:
    assert stale_tokens(sample(versions, len(versions)), expected) == sum(
        v != expected for v in versions
    )
    # a generated token without a recorded version counts too
    assert stale_tokens(sample(versions, len(versions) + 2), expected) == (
        sum(v != expected for v in versions) + 2
    )


@given(st.integers(0, 2**63 - 1))
@example(521965)  # CRC-32 gave two of these 4096 ids one seed
def test_the_episodes_of_a_step_get_distinct_stable_seeds(seed: int) -> None:
    ids = [str(i) for i in range(2048)] + [f"{i}/t1" for i in range(2048)]  # turns too
    seeds = [request_seed(seed, sample_id) for sample_id in ids]
    assert len(set(seeds)) == len(ids)
    assert all(0 <= s < 2**63 for s in seeds)
    assert seeds == [request_seed(seed, sample_id) for sample_id in ids]


def test_engine_demo_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="repetitions"):
        EngineDemoConfig(experiment=ExperimentConfig(), repetitions=0)
    config = EngineDemoConfig(experiment=ExperimentConfig())
    assert config.runtime().pin_cores and config.repetitions == 3


def test_the_vllm_demo_refuses_an_interpreter_without_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DYNARL_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    assert main(["demo", "--engine", "vllm", "--no-live", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no-such-python does not exist" in err and "vllm" in err
    assert not list(tmp_path.glob("demo-vllm-*"))  # nothing was started or written
