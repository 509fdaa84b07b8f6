"""The driver's barrier decision: grow the trainer only when it pays (``grow_pays``)."""

from __future__ import annotations

import pytest

from dynarl.demo._device_schedules import grow_pays


def test_a_few_micro_batches_left_do_not_pay_for_a_grow_and_a_shrink() -> None:
    # 2 left on 1 device: growing to 2 saves one micro-batch (0.07 s), costs 2 x 0.2 s.
    assert not grow_pays(remaining=2, held=1, total=2, micro_s=0.07, move_s=0.2)


def test_a_whole_step_left_pays_for_a_grow() -> None:
    # 16 left on 1 device: growing saves 8 micro-batches (0.56 s) > 0.4 s.
    assert grow_pays(remaining=16, held=1, total=2, micro_s=0.07, move_s=0.2)


def test_free_moves_pay_whenever_a_device_learns_less() -> None:
    assert grow_pays(remaining=3, held=1, total=2, micro_s=0.07, move_s=0.0)
    # One left: a second device would learn nothing.
    assert not grow_pays(remaining=1, held=1, total=2, micro_s=0.07, move_s=0.0)


def test_nothing_left_or_every_device_held_never_grows() -> None:
    assert not grow_pays(remaining=0, held=1, total=2, micro_s=1.0, move_s=0.0)
    assert not grow_pays(remaining=9, held=2, total=2, micro_s=1.0, move_s=0.0)


def test_without_a_measured_learn_time_it_grows_when_a_device_would_learn_two() -> None:
    assert grow_pays(remaining=2, held=1, total=2, micro_s=None, move_s=10.0)
    assert not grow_pays(remaining=1, held=1, total=2, micro_s=None, move_s=0.0)


def test_no_held_device_is_refused() -> None:
    with pytest.raises(ValueError, match="held"):
        grow_pays(remaining=2, held=0, total=2, micro_s=0.1, move_s=0.1)
