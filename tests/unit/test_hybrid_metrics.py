"""The dynamic_resource/* metrics, by seed 004 §4's formulas."""

from __future__ import annotations

import pytest

from dynarl.sched import DynamicResourceMetrics, RolloutUtilization
from dynarl.sched._metrics import (
    resource_utilization,
    rollout_capacity,
    rollout_resource_utilization,
    train_compute_time,
    train_resource_utilization,
)


def test_train_utilization_sums_first_then_divides() -> None:
    timing = {
        "reward": 1.0,
        "old_log_prob": 2.0,
        "ref": 0.5,
        "adv": 0.5,
        "update_actor": 4.0,
        "gen": 99.0,
    }
    assert train_compute_time(timing) == 8.0  # values/update_critic missing -> 0; gen not compute
    # Per-step ratios would average to (0.5 + 0.9) / 2 = 0.7; summed first it is 10/12.
    assert train_resource_utilization([1.0, 9.0], [2.0, 10.0]) == pytest.approx(10 / 12)
    assert train_resource_utilization([], []) == 0.0


def test_rollout_utilization_weights_each_interval_by_its_own_capacity() -> None:
    assert rollout_capacity(servers=3, samples_per_replica=8, max_required_samples=20) == 20
    assert rollout_capacity(servers=2, samples_per_replica=8, max_required_samples=20) == 16
    history = [(0.0, 5, 10), (10.0, 30, 20), (20.0, 0, 20), (30.0, 0, 0), (35.0, 0, 0)]
    # used = 10·5 + 10·20 + 10·0 = 250; capacity-time = 10·10 + 10·20 + 10·20 = 500.
    assert rollout_resource_utilization(history) == 0.5
    assert rollout_resource_utilization([(0.0, 3, 0), (9.0, 3, 0)]) == 0.0


def test_tracker_corrects_the_placeholder_capacity_and_closes_windows() -> None:
    tracker = RolloutUtilization()
    tracker.record(0.0, 4, None)  # seed point before the capacity is known
    tracker.record(10.0, 8, 8)
    assert tracker.history[0] == (0.0, 4, 8)
    assert tracker.close(20.0) == pytest.approx((10 * 4 + 10 * 8) / (10 * 8 + 10 * 8))
    tracker.record(25.0, 2, 8)
    assert tracker.close(30.0) == pytest.approx((5 * 8 + 5 * 2) / (10 * 8))


def test_cluster_utilization_splits_hybrid_time_between_train_and_rollout() -> None:
    value = resource_utilization(
        hybrid_devices=16,
        standalone_devices=16,
        train_utilization=0.8,
        rollout_utilization=0.6,
        wait_s=30.0,
        step_s=120.0,
    )
    x = 0.25
    assert value == pytest.approx(((1 - x) * 16 * 0.8 + (x * 16 + 16) * 0.6) / 32)
    never = resource_utilization(
        hybrid_devices=8,
        standalone_devices=24,
        train_utilization=1.0,
        rollout_utilization=0.5,
        wait_s=0.0,
        step_s=0.0,
    )
    assert never == pytest.approx((8 * 1.0 + 24 * 0.5) / 32)
    clipped = resource_utilization(
        hybrid_devices=8,
        standalone_devices=0,
        train_utilization=1.0,
        rollout_utilization=0.5,
        wait_s=50.0,
        step_s=10.0,
    )
    assert clipped == 0.5


def test_cycle_aggregation_reports_every_metric_and_the_last_queue_size() -> None:
    metrics = DynamicResourceMetrics(hybrid_devices=16, standalone_devices=16)
    metrics.add_step(
        timing={"update_actor": 6.0},
        allocated_s=10.0,
        step_s=10.0,
        wait_for_samples_s=2.0,
        mq_size=7,
    )
    metrics.add_step(timing={"update_actor": 8.0}, allocated_s=10.0, step_s=10.0, mq_size=3)
    out = metrics.cycle(rollout_utilization=0.5)
    assert out["dynamic_resource/train_compute_time_s"] == 14.0
    assert out["dynamic_resource/train_allocated_time_s"] == 20.0
    assert out["dynamic_resource/train_resource_utilization"] == 0.7
    assert out["dynamic_resource/rollout_resource_utilization"] == 0.5
    assert out["dynamic_resource/mq_size"] == 3.0
    x = 2.0 / 20.0
    assert out["dynamic_resource/resource_utilization"] == pytest.approx(
        ((1 - x) * 16 * 0.7 + (x * 16 + 16) * 0.5) / 32
    )
    assert metrics.cycle(0.0)["dynamic_resource/train_compute_time_s"] == 0.0
