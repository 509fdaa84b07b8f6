"""The GRPO driver's phase-switch decisions (pure): where a rollout starts, where the
trainer wakes at the barrier, and when it grows onto every device."""

from __future__ import annotations

import pytest

from dynarl.demo._device_schedules import RunPlan, Schedule
from dynarl.demo._phase_moves import grow_target, rollout_route, wake_target
from dynarl.types import Allocation

DYNARL = RunPlan(schedule=Schedule.DYNARL, num_devices=3)
HOME = Allocation.of({"rollout": (0, 1), "trainer": (2,)})
EVERYWHERE = Allocation.of({"rollout": (), "trainer": (0, 1, 2)})
ROLLOUT = Allocation.of({"rollout": (0, 1, 2), "trainer": ()})


def test_a_grown_trainer_shrinks_home_before_the_rollout_takes_every_device() -> None:
    assert rollout_route(DYNARL, EVERYWHERE, resume=False) == (HOME, ROLLOUT)


def test_resuming_keeps_the_trainer_on_its_home_device() -> None:
    assert rollout_route(DYNARL, EVERYWHERE, resume=True) == (HOME, HOME)
    assert rollout_route(DYNARL, HOME, resume=True) == (HOME,)


def test_static_schedules_go_straight_to_their_rollout_phase() -> None:
    sequential = RunPlan(schedule=Schedule.SEQUENTIAL, num_devices=3)
    split = RunPlan(schedule=Schedule.SPLIT, num_devices=3, num_rollout_devices=2)
    assert rollout_route(sequential, EVERYWHERE, resume=True) == (ROLLOUT,)
    assert rollout_route(split, HOME, resume=False) == (HOME,)


def test_only_a_dynarl_trainer_without_devices_wakes_at_home() -> None:
    assert wake_target(DYNARL, ROLLOUT) == HOME
    assert wake_target(DYNARL, HOME) is None
    assert wake_target(RunPlan(schedule=Schedule.SEQUENTIAL, num_devices=3), ROLLOUT) is None


def test_dynarl_grows_only_when_it_pays() -> None:
    # 12 left on 1 device: 3 devices save 8 micro-batches x 0.1 s > 2 x 0.2 s.
    assert grow_target(DYNARL, HOME, remaining=12, micro_s=0.1, move_s=0.2) == EVERYWHERE
    assert grow_target(DYNARL, HOME, remaining=2, micro_s=0.1, move_s=0.2) is None


def test_sequential_always_and_split_never_take_the_learner_phase() -> None:
    sequential = RunPlan(schedule=Schedule.SEQUENTIAL, num_devices=3)
    split = RunPlan(schedule=Schedule.SPLIT, num_devices=3, num_rollout_devices=2)
    assert grow_target(sequential, ROLLOUT, remaining=1, micro_s=9.0, move_s=9.0) == EVERYWHERE
    assert grow_target(split, HOME, remaining=99, micro_s=9.0, move_s=0.0) is None


def test_a_dynarl_trainer_must_wake_before_it_grows() -> None:
    with pytest.raises(ValueError, match="held"):
        grow_target(DYNARL, ROLLOUT, remaining=4, micro_s=None, move_s=0.0)
