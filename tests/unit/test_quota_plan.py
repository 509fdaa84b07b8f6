"""A quota change as a pure plan: accepted grants, forced shrinks, refusals that move nothing."""

from __future__ import annotations

from sched_support import NODES, START

from dynarl.sched import SchedulerConfig
from dynarl.sched._events import QuotaChange
from dynarl.sched._quota import QuotaPlan, plan_quota_change

CONFIG = SchedulerConfig(num_devices_per_node=4, min_quota_devices=4, max_quota_devices=24)


def plan(change: QuotaChange, quota: set[int] | None = None) -> QuotaPlan:
    return plan_quota_change(
        change,
        quota=set(range(16)) if quota is None else quota,
        allocation=START,
        nodes=NODES,
        config=CONFIG,
    )


def test_a_grant_adds_only_new_devices_and_moves_nothing() -> None:
    p = plan(QuotaChange(granted=(14, 15, 16, 17)))
    assert not p.refused and p.granted == {16, 17} and p.num_devices == 18
    assert p.moves == () and p.new_allocation is None


def test_a_reclaim_shrinks_its_holder_to_a_valid_size() -> None:
    p = plan(QuotaChange(reclaimed=(12, 99)))
    assert not p.refused and p.reclaimed == {12} and p.num_devices == 15
    (move,) = p.moves
    assert move.src == "trainer" and move.dst is None and 12 in move.devices
    assert p.new_allocation is not None
    assert p.new_allocation.count("trainer") == 2  # 3 left is no TP-2 size: one more goes
    assert p.new_allocation.devices("rollout") == START.devices("rollout")
    assert set(p.new_allocation.devices("trainer")).isdisjoint(move.devices)


def test_a_reclaim_below_a_minimum_is_refused_and_moves_nothing() -> None:
    p = plan(QuotaChange(reclaimed=(12, 13, 14)))
    assert p.refused == "reclaim refused: trainer would fall below its minimum of 2 devices"
    assert p.moves == () and p.new_allocation is None


def test_a_change_outside_the_elastic_bounds_is_refused() -> None:
    too_big = plan(QuotaChange(granted=tuple(range(16, 30))))
    too_small = plan(QuotaChange(reclaimed=tuple(range(13))))
    assert "outside the job's elastic bounds" in too_big.refused
    assert "outside the job's elastic bounds" in too_small.refused
    assert too_big.moves == () == too_small.moves
