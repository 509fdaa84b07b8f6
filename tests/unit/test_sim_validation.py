"""Validation against the DynaRL paper, as tests of the calibration (issue 7, item 5).

The shipped workloads are derived from facts by ``examples/workloads/calibrate.py``; these
tests compare what the simulator then predicts with the paper's results. Where the
simulator disagrees, the test either asserts what the model gives (with the reason in its
docstring) or is an ``xfail(strict=True)`` whose reason says by how much and why — both
fail loudly if the disagreement goes away, so the reason is kept true. The figures and
the reasons are collected in docs/calibration.md, "Validation".
Nothing here tunes anything: every run uses a shipped file as it is (sweeps change only
the swept scheduler parameter).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
from sim_support import WORKLOADS, shipped

from dynarl.sim import run_policy, with_overrides
from dynarl.sim._results import RunResult


@cache
def result(workload: str, policy: str, key: str = "", value: float = 0.0) -> RunResult:
    chosen = shipped(workload)
    if key:
        chosen = with_overrides(chosen, {key: value})
    return run_policy(chosen, policy)


@cache
def vector_result(workload: str, policy: str) -> RunResult:
    return run_policy(shipped(workload), policy, vector=True)


def speedup(workload: str, policy: str, baseline: str) -> float:
    return result(workload, policy).throughput / result(workload, baseline).throughput


def test_math_7b_64gpu_dynarl_over_static_sequential_as_modelled() -> None:
    """The paper reports 1.4-1.7x here; this calibration gives ~1.21x, and no policy 1.4x.

    Static-sequential is rollout on 64 GPUs (~410 s) then log-prob and training (~237 s).
    dynarl starts with rollout on all 64 GPUs too (the trainer parked in host memory, A22)
    and can only overlap the downstream with rollout's tail: until ~91% of the samples are
    done (~225 s) fewer than 80% of the engines are below U_low = 0.2 of their KV (Stage 1
    finds no donor), and the tail it then merges onto fewer engines decodes slower (its
    long contexts make each step read more KV), so rollout ends ~70 s later (~481 s) and
    ~48 s of training follows it. ``examples/workloads/overlap_bound.py`` finds no rollout
    shrink schedule beating ~484 s per iteration (1.33x), even with free migrations and
    perfect packing; ``examples/workloads/sensitivity.py`` showed no single modelling
    choice (KV read cost, roofline GEMMs, KV capacity, downstream speed) taking dynarl past
    1.24x before parking. Why the paper's figure is higher: docs/calibration.md,
    "Validation". If the model ever reaches the paper's range this test fails, and the
    reason is revisited.
    """
    ratio = speedup("math-7b-64gpu", "dynarl", "static-sequential")
    assert 1.1 <= ratio < 1.4


def test_math_7b_64gpu_dynarl_beats_rlinf_rule_and_verl_hybrid() -> None:
    assert speedup("math-7b-64gpu", "dynarl", "rlinf-rule") > 1.0
    assert speedup("math-7b-64gpu", "dynarl", "verl-hybrid") > 1.0


# ~75 s of simulation on two cores: `make test-slow` (make test's budget is 15 minutes).
@pytest.mark.slow
def test_agentic_priority_beats_plain_dynarl() -> None:
    assert speedup("agentic-32b-64gpu", "dynarl+priority", "dynarl") > 1.0


@pytest.mark.slow
def test_agentic_priority_beats_plain_dynarl_at_32b_128gpu() -> None:
    assert speedup("agentic-32b-128gpu", "dynarl+priority", "dynarl") > 1.0


@pytest.mark.slow
def test_agentic_7b_64gpu_priority_ties_plain_dynarl_as_modelled() -> None:
    """The paper has priority 11-24% ahead; here the two tie (501.5 s against 502.3 s an
    iteration, re-prefill shares 0.545 and 0.544). Its earlier +1.4% (and, after parking, its
    -0.1%) came from a race, gone since the simulator hands an instant's reports to the
    scheduler as one batch: a round ran on rollout's report while inference's was one
    interval old, released inference's last replica just as rollout's last group reached
    it, and that group waited ~100 s for the trainer to free devices. Without the race the
    iteration is set by the rollout tail and the trainer, which request order barely
    changes (10 moves an iteration each). If priority
    ever gains or loses more than 0.5% here, this test fails and the reason is revisited.
    """
    ratio = speedup("agentic-7b-64gpu", "dynarl+priority", "dynarl")
    assert ratio == pytest.approx(1.0, abs=0.005)


def _u_low(value: float) -> float:
    return result("math-1.5b-64gpu", "dynarl", "u_low", value).throughput


# The paper's plateaus (Fig. 15): U_low 0.1-0.3 within 1.5% of the peak, T 2-8 s within
# 0.5%. A "loss" is a drop below the plateau by more than its own width.
U_LOW_PLATEAU = 0.985
T_WINDOW_PLATEAU = 0.995


@pytest.mark.slow  # a sweep (~20 s of simulation): make test-slow
def test_u_low_sweep_loses_at_0_01_against_the_plateau() -> None:
    assert _u_low(0.01) < U_LOW_PLATEAU * min(_u_low(v) for v in (0.1, 0.2, 0.3))


@pytest.mark.xfail(
    strict=True,
    reason="on math-1.5b-64gpu every rollout engine stays below ~0.2 of its KV capacity "
    "(8192 sequences over 64 engines of 2.4M tokens), so from U_low = 0.2 up Stage 1 flags "
    "rollout as a donor T seconds into every iteration and Stage 2 alone decides: U_low 0.2 "
    "and 0.3 give the same run, 0.5 one 1.2% slower (14 moves against 13.5), on the plateau. "
    "The paper's "
    "loss at 0.5 (-14.1%, 'reluctant to reconfigure') would need the opposite of Stage 1's "
    "rule (a higher U_low means more donors), or engines much fuller than this calibration's.",
)
def test_u_low_sweep_loses_at_0_5() -> None:
    assert _u_low(0.5) < U_LOW_PLATEAU * min(_u_low(v) for v in (0.1, 0.2, 0.3))


def _t_window(value: float) -> float:
    return result("math-1.5b-64gpu", "dynarl", "t_window", value).throughput


@pytest.mark.slow  # a sweep (~20 s of simulation): make test-slow
@pytest.mark.parametrize("window", [32.0, 64.0])
def test_t_window_sweep_loses_at_32_and_64_seconds(window: float) -> None:
    assert _t_window(window) < T_WINDOW_PLATEAU * min(_t_window(v) for v in (2.0, 4.0, 8.0))


def _ramp(policy: str, gpus: int) -> float:
    """Mean time from a measured iteration's start until the trainer holds ``gpus`` again."""
    run = result("math-7b-64gpu", policy)
    times = []
    for it in run.iterations[1:]:
        t = run.timeline.ramp_time("trainer", gpus, it.start, it.end)
        assert t is not None, f"the trainer never reached {gpus} GPUs under {policy}"
        times.append(t - it.start)
    return sum(times) / len(times)


def test_held_out_7b_timeline_with_priority_within_15_percent() -> None:
    """Held out: with priority the paper's trainer holds 52 GPUs at ~380 s. Here ~414 s
    (+9%): rollout starts on all 64 GPUs (the trainer parked), Stage 1 first flags it at
    ~225 s and the trainer grows with each release until rollout's last engines go."""
    assert _ramp("dynarl+priority", 52) == pytest.approx(380.0, rel=0.15)


@pytest.mark.xfail(
    strict=True,
    reason="held-out fact: without priority the paper's trainer reaches 32 GPUs only at "
    "~420 s; the simulator gives ~298 s (-29%), on the same ramp as with priority (32 GPUs "
    "near 300 s, 52 near 415-420 s): math requests never call tools (k_r = 0) and a GRPO "
    "group's siblings share one engine and one cached prompt, so DynaRL's key (k_r, m_r) "
    "orders them as FIFO does, and a re-dispatched partial request finds nothing of its own "
    "cached on its new engine. The paper's gap between the two runs has no mechanism in "
    "this model.",
)
def test_held_out_7b_timeline_without_priority_within_15_percent() -> None:
    assert _ramp("dynarl", 32) == pytest.approx(420.0, rel=0.15)


def test_held_out_7b_timeline_shape() -> None:
    """What does hold: the trainer grows late in the iteration, to about 52 GPUs or more."""
    for policy in ("dynarl", "dynarl+priority"):
        run = result("math-7b-64gpu", policy)
        for it in run.iterations[1:]:
            assert run.timeline.peak("trainer", it.start, it.end) >= 52
            t32 = run.timeline.ramp_time("trainer", 32, it.start, it.end)
            assert t32 is not None and t32 - it.start > 0.4 * it.seconds


@pytest.mark.parametrize("workload", ["math-1.5b-128gpu", "math-7b-128gpu"])
@pytest.mark.parametrize("policy", ["static-split", "dynarl"])
def test_vector_model_within_2_percent_at_128_gpus(workload: str, policy: str) -> None:
    request = result(workload, policy).throughput
    assert vector_result(workload, policy).throughput == pytest.approx(request, rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["math-1.5b-128gpu", "math-7b-128gpu", "math-32b-128gpu"])
@pytest.mark.parametrize("policy", ["static-sequential", "static-split", "rlinf-rule", "dynarl"])
def test_vector_model_within_2_percent_everywhere(workload: str, policy: str) -> None:
    request = result(workload, policy).throughput
    assert vector_result(workload, policy).throughput == pytest.approx(request, rel=0.02)


# Never worse than holding still: a dynamic policy may gain little on a balanced workload,
# but it must not lose to the best static one ("best static": the better of
# static-sequential and static-split), within 1%.
NEVER_WORSE = 0.99
REGRESSION = 1.005
PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "workloads.md"


def best_static(workload: str) -> float:
    return max(result(workload, p).throughput for p in ("static-sequential", "static-split"))


# ~75 s of simulation on two cores: `make test-slow` (make test's budget is 15 minutes).
@pytest.mark.slow
def test_agentic_32b_64gpu_dynarl_never_loses_to_the_best_static_policy() -> None:
    """The stranded trainer replica: a finished rollout that keeps one 4-GPU engine to the
    barrier leaves the TP-8 trainer 56 of the 64 GPUs (0.97x static-sequential); a
    finished rollout parks, and the trainer takes every GPU."""
    for policy in ("dynarl", "dynarl+priority"):
        assert result("agentic-32b-64gpu", policy).throughput >= NEVER_WORSE * best_static(
            "agentic-32b-64gpu"
        ), policy


@pytest.mark.slow
def test_agentic_32b_128gpu_dynarl_never_loses_to_the_best_static_policy() -> None:
    workload = "agentic-32b-128gpu"
    assert result(workload, "dynarl").throughput >= NEVER_WORSE * best_static(workload)


SHIPPED = sorted(path.stem for path in WORKLOADS.glob("*.toml"))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dynarl", "dynarl+priority"])
@pytest.mark.parametrize("workload", SHIPPED)
def test_no_shipped_workload_loses_to_the_best_static_policy(workload: str, policy: str) -> None:
    assert result(workload, policy).throughput >= NEVER_WORSE * best_static(workload)


def documented() -> dict[tuple[str, str], float]:
    """Iteration seconds by (workload, policy) from the table of docs/workloads.md,
    "Measured iteration times"."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## Measured iteration times") :]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    header = [c.strip() for c in section[section.index("| workload") :].splitlines()[0].split("|")]
    out = {}
    for line in rows:
        cells = [c.strip() for c in line.split("|")]
        for column, cell in zip(header, cells, strict=True):
            if column in ("dynarl", "dynarl+priority", "static-sequential", "static-split"):
                out[(cells[1].strip("`"), column)] = float(re.sub(r"[ s,]", "", cell))
    return out


def test_the_documented_table_covers_every_shipped_workload() -> None:
    table = documented()
    for workload in SHIPPED:
        for policy in ("static-sequential", "static-split", "dynarl", "dynarl+priority"):
            assert (workload, policy) in table, (workload, policy)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dynarl", "dynarl+priority"])
@pytest.mark.parametrize("workload", SHIPPED)
def test_no_iteration_time_regresses_against_the_documented_table(
    workload: str, policy: str
) -> None:
    documented_s = documented()[(workload, policy)]
    assert result(workload, policy).iteration_s <= REGRESSION * documented_s
