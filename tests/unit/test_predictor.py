"""The default throughput predictor: robustness to outliers, shape, error tracking."""

from __future__ import annotations

import numpy as np
import pytest
from sched_support import report

from dynarl.bus import ComponentReport
from dynarl.sched import ComponentProfile, ProfilePoint, RegressionPredictor, ThroughputPredictor
from dynarl.sched._sched_config import PredictorConfig

NUM_SAMPLES = 30
"""Online samples after which the outlier bound is claimed."""


def truth(n: float, remaining: float, a: float = 50.0, b: float = 0.8, q: float = 16.0) -> float:
    s = remaining / q
    return a * (n * s / (n + s)) ** b


def drifted_predictor(estimator: str = "theil_sen") -> RegressionPredictor:
    # The offline profile is 20% off the live level: the online window must correct it.
    profile = ComponentProfile(
        points=tuple(
            ProfilePoint(num_devices=n, throughput=truth(n, 1e12, a=40.0))
            for n in (1, 2, 4, 8, 16, 32)
        ),
        items_per_device=16.0,
    )
    return RegressionPredictor({"rollout": profile}, PredictorConfig(estimator=estimator))  # type: ignore[arg-type]


def feed_with_outliers(pred: RegressionPredictor, seed: int, count: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.choice([8, 16, 24, 32, 48, 64]))
        remaining = int(rng.integers(50, 5000))
        y = truth(n, remaining) * (1 + 0.05 * rng.standard_normal())
        if rng.random() < 0.2:  # 20% outliers: off by 2x to 20x either way
            y *= float(rng.choice([rng.uniform(0.05, 0.5), rng.uniform(2.0, 10.0)]))
        pred.observe("rollout", n, report("rollout", remaining=remaining, throughput=y))
        pred.refit()


def median_error(pred: RegressionPredictor) -> float:
    errors = [
        abs(
            float(pred.predict("rollout", np.array([n]), report("rollout", remaining=r))[0])
            - truth(n, r)
        )
        / truth(n, r)
        for n in (4, 8, 16, 32, 64)
        for r in (100, 500, 1000, 4000)
    ]
    return float(np.median(errors))


@pytest.mark.parametrize("seed", range(8))
def test_median_relative_error_within_10_percent_with_20_percent_outliers(seed: int) -> None:
    pred = drifted_predictor()
    assert isinstance(pred, ThroughputPredictor)
    assert median_error(pred) > 0.15  # the drifted profile alone is off
    feed_with_outliers(pred, seed, NUM_SAMPLES)
    assert median_error(pred) <= 0.10


def test_least_squares_is_not_robust_to_the_same_outliers() -> None:
    # The measurement behind choosing Theil–Sen: plain least squares on the same data.
    errors = []
    for seed in range(8):
        pred = drifted_predictor("ols")
        feed_with_outliers(pred, seed, NUM_SAMPLES)
        errors.append(median_error(pred))
    assert max(errors) > 0.10


def test_rollout_is_concave_in_devices_and_flattens_as_queries_run_out() -> None:
    pred = drifted_predictor()
    n = np.arange(1, 65, dtype=np.float64)
    busy = pred.predict("rollout", n, report("rollout", remaining=100_000))
    tail = pred.predict("rollout", n, report("rollout", remaining=40))
    assert np.all(np.diff(busy) > 0) and np.all(np.diff(busy, 2) <= 1e-9)
    assert np.all(np.diff(tail) >= 0) and np.all(np.diff(tail, 2) <= 1e-9)
    assert tail[-1] / tail[15] < 1.1  # 16 -> 64 devices: almost nothing more in the tail
    assert busy[-1] / busy[7] > 4.0


def test_trainer_is_near_linear_when_fed_and_starved_samples_are_skipped() -> None:
    pred = RegressionPredictor({"trainer": ComponentProfile(exponent=0.7)})
    assert pred.predict("trainer", np.array([8.0]), report("trainer")).item() == 0.0  # unfitted
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.choice([4, 8, 16, 32]))
        fed = report(
            "trainer", queue_depth=64, throughput=3.0 * n * (1 + 0.02 * rng.standard_normal())
        )
        pred.observe("trainer", n, fed)
        pred.observe("trainer", n, report("trainer", queue_depth=0, throughput=0.5))  # starved
        pred.refit()
    y = pred.predict("trainer", np.array([8.0, 16.0]), report("trainer"))
    assert y[1] / y[0] == pytest.approx(2.0, rel=0.05)
    assert y[0] == pytest.approx(24.0, rel=0.05)


def test_errors_are_recorded_before_learning_and_observe_does_not_refit() -> None:
    pred = RegressionPredictor(
        {
            "r": ComponentProfile(
                points=(ProfilePoint(num_devices=1, throughput=10.0),), exponent=1.0
            )
        }
    )
    before = pred.predict("r", np.array([4.0]), report("r")).item()
    pred.observe("r", 4, report("r", throughput=80.0, queue_depth=1))  # truth doubled
    assert pred.predict("r", np.array([4.0]), report("r")).item() == before  # no refit yet
    assert pred.prediction_error("r") == (pytest.approx(0.5), 1)
    for _ in range(5):
        pred.observe("r", 4, report("r", throughput=80.0, queue_depth=1))
    pred.refit()
    assert pred.predict("r", np.array([4.0]), report("r")).item() == pytest.approx(80.0)
    assert pred.prediction_error("unknown") == (0.0, 0)


def test_a_new_iteration_restarts_the_online_window_from_the_profile() -> None:
    profile = ComponentProfile(
        points=tuple(ProfilePoint(num_devices=n, throughput=10.0 * n) for n in (1, 2, 4, 8)),
    )
    pred = RegressionPredictor({"trainer": profile})

    def state(time: float, iteration: int, throughput: float) -> ComponentReport:
        return report(
            "trainer",
            kind="trainer",
            time=time,
            queue_depth=5,
            throughput=throughput,
            iteration=iteration,
        )

    for k in range(10):  # iteration 0 runs at a third of the profiled level
        pred.observe("trainer", 4, state(float(k), 0, 13.3))
    pred.refit()
    assert pred.predict("trainer", np.array([4.0]), state(11.0, 0, 13.3))[0] == pytest.approx(
        13.3, rel=0.05
    )
    assert pred.prediction_error("trainer")[1] > 1
    fresh = state(12.0, 1, 40.0)
    pred.observe("trainer", 4, fresh)  # judged against the profile, not iteration 0's level
    assert pred.prediction_error("trainer") == (pytest.approx(0.0), 1)
    pred.refit()
    assert pred.predict("trainer", np.array([4.0]), fresh)[0] == pytest.approx(40.0, rel=0.05)
