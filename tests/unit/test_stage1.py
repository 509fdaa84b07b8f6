"""Stage 1: per-worker metrics aggregation, sliding windows, donor detection, config checks."""

from __future__ import annotations

import numpy as np
import pytest
from sched_support import report

from dynarl.bus import WorkerMetrics
from dynarl.sched import MetricsBuffer, SchedulerConfig
from dynarl.sched._telemetry import aggregate_metrics
from dynarl.sched._window import WindowSet, detect_donors


def metrics(worker: int, util: float, **kw: object) -> WorkerMetrics:
    return WorkerMetrics(
        component="rollout", worker=worker, time=1.0, interval_s=1.0, utilization=util, **kw
    )


def test_aggregation_folds_workers_into_one_report() -> None:
    rep = aggregate_metrics(
        "rollout",
        "rollout",
        [
            metrics(0, 0.5, queue_depth=3, completed=4, in_flight=2),
            metrics(2, 1.5, queue_depth=1, completed=6, in_flight=1, interruptible=False),
        ],
        num_workers=3,
        interval_s=2.0,
    )
    assert rep.utilization == (0.5, 0.0, 1.0)  # clipped to [0, 1], silent worker at 0
    assert rep.queue_depth == 4 and rep.throughput == 5.0 and rep.completed == 10
    assert rep.remaining == 4 + 3 and not rep.interruptible and rep.time == 1.0


def test_buffer_keeps_state_across_intervals_and_columns_match_messages() -> None:
    by_message = MetricsBuffer("rollout", "rollout", 4)
    by_column = MetricsBuffer("rollout", "rollout", 4)
    util = np.array([0.1, 0.2, 0.3, 0.4])
    for w in range(4):
        by_message.add(metrics(w, float(util[w]), queue_depth=w, completed=1, in_flight=1))
    workers = np.arange(4)
    by_column.add_columns(
        workers,
        util,
        queue_depth=workers,
        completed=np.ones(4, dtype=np.int64),
        in_flight=np.ones(4, dtype=np.int64),
    )
    first = by_message.report(time=1.0, interval_s=1.0)
    assert first == by_column.report(time=1.0, interval_s=1.0)
    by_message.add(metrics(1, 0.9, completed=2))
    second = by_message.report(time=2.0, interval_s=1.0, remaining=7, iteration=3)
    assert second.utilization == (0.1, 0.9, 0.3, 0.4)
    assert second.completed == 6 and second.throughput == 2.0 and second.remaining == 7
    by_message.new_iteration()
    assert by_message.report(time=3.0, interval_s=1.0).completed == 0


def test_buffer_rejects_foreign_and_unknown_workers() -> None:
    buffer = MetricsBuffer("rollout", "rollout", 2)
    with pytest.raises(ValueError, match="sent to 'rollout'"):
        buffer.add(
            WorkerMetrics(component="trainer", worker=0, time=0.0, interval_s=1.0, utilization=0.1)
        )
    with pytest.raises(ValueError, match="no worker 5"):
        buffer.add(metrics(5, 0.1))
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        buffer.report(interval_s=0.0)


def feed(windows: WindowSet, utils: list[float], t0: float, t1: float) -> None:
    for t in np.arange(t0, t1 + 1e-9, 1.0):
        windows.observe(report("rollout", time=float(t), utilization=tuple(utils)))


def test_donor_needs_theta_of_workers_below_u_low_for_t_seconds() -> None:
    config = SchedulerConfig()  # θ = 0.8, U_low = 0.2, T = 4 s
    windows = WindowSet(config)
    idle8 = [0.1] * 8 + [0.9] * 2
    feed(windows, idle8, 1.0, 3.0)  # below since t=0, only 3 s so far
    assert detect_donors(windows.stats(), config) == ()
    feed(windows, idle8, 4.0, 4.0)  # 4 s below: 8 of 10 workers = θ
    (donor,) = detect_donors(windows.stats(), config)
    assert donor.component == "rollout" and donor.idle_fraction == pytest.approx(0.8)
    idle7 = [0.1] * 7 + [0.9] * 3
    feed(windows, idle7, 5.0, 5.0)  # worker 7 rose above U_low: its clock restarts
    assert detect_donors(windows.stats(), config) == ()
    relaxed = SchedulerConfig(donor_fraction=0.7)
    assert detect_donors(windows.stats(), relaxed)[0].idle_fraction == pytest.approx(0.7)


def test_util_exactly_at_u_low_is_not_idle_and_resize_restarts_clocks() -> None:
    config = SchedulerConfig(donor_window_s=2.0)
    windows = WindowSet(config)
    feed(windows, [0.2] * 4, 1.0, 5.0)
    assert detect_donors(windows.stats(), config) == ()
    feed(windows, [0.0] * 4, 6.0, 8.0)
    assert detect_donors(windows.stats(), config)
    feed(windows, [0.0] * 3, 9.0, 9.0)  # resized to three workers
    assert windows.stats()["rollout"].idle_fraction == 0.0
    feed(windows, [0.0] * 3, 10.0, 10.0)
    assert windows.stats()["rollout"].idle_fraction == 1.0


def test_non_interruptible_component_is_not_a_donor_and_stats_are_windowed() -> None:
    config = SchedulerConfig(stats_window_s=5.0)
    windows = WindowSet(config)
    for t in range(1, 11):
        windows.observe(
            report(
                "r", time=float(t), utilization=(0.0,), throughput=float(t), interruptible=t < 10
            )
        )
    stats = windows.stats()["r"]
    assert not stats.interruptible and detect_donors({"r": stats}, config) == ()
    assert stats.throughput == pytest.approx(np.mean([5, 6, 7, 8, 9, 10]))
    with pytest.raises(ValueError, match="older than the latest"):
        windows.observe(report("r", time=3.0))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("donor_fraction", 0.0),
        ("donor_fraction", 1.5),
        ("util_low", -0.1),
        ("donor_window_s", 0.0),
        ("num_candidates", 2),
        ("num_candidates", 11),
        ("max_failed_moves", 0),
        ("stats_window_s", 1.0),
        ("min_gain_s", float("nan")),
        ("max_quota_devices", 0),
    ],
)
def test_config_rejects_out_of_range(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})  # type: ignore[arg-type]


def test_config_defaults_are_the_papers() -> None:
    config = SchedulerConfig()
    assert (config.donor_fraction, config.util_low, config.donor_window_s) == (0.8, 0.2, 4.0)
