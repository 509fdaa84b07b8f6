"""``bench/priority.py``'s gains are paired by round: a host whose speed drifts between
rounds (every run of a round alike) does not move them, and the A/A noise is the largest
relative difference of the two FIFO runs of a round."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parents[2] / "bench"

NAMES = ("fifo", "fifo-aa", "dynarl")

times = st.floats(min_value=1.0, max_value=100.0, allow_nan=False)
speeds = st.floats(min_value=0.25, max_value=4.0, allow_nan=False)


@pytest.fixture(scope="module")
def moving() -> Iterator[ModuleType]:
    name = "bench_priority_moving"
    spec = importlib.util.spec_from_file_location(name, BENCH / "_priority_moving.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    sys.path.insert(0, str(BENCH))  # it imports its sibling modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
        del sys.modules[name]


@st.composite
def rounds(draw: st.DrawFn) -> dict[str, list[float]]:
    n = draw(st.integers(min_value=1, max_value=7))
    return {name: draw(st.lists(times, min_size=n, max_size=n)) for name in NAMES}


@given(walls=rounds(), data=st.data())
def test_a_host_that_drifts_between_rounds_moves_no_paired_figure(
    moving: ModuleType, walls: dict[str, list[float]], data: st.DataObject
) -> None:
    n = len(walls["fifo"])
    scale = data.draw(st.lists(speeds, min_size=n, max_size=n), label="per-round slow-down")
    drifted = {name: [t * s for t, s in zip(ts, scale, strict=True)] for name, ts in walls.items()}
    for slower, faster in (("fifo", "dynarl"), ("dynarl", "fifo"), ("fifo", "fifo-aa")):
        assert math.isclose(
            moving.paired_gain(drifted, slower, faster),
            moving.paired_gain(walls, slower, faster),
            rel_tol=1e-9,
            abs_tol=1e-12,
        )
    assert math.isclose(moving.aa_noise(drifted), moving.aa_noise(walls), abs_tol=1e-12)


def test_the_paired_gain_is_the_median_of_the_rounds_ratios_not_the_ratio_of_medians(
    moving: ModuleType,
) -> None:
    # Measured on one SGLang bench run (fresh clone of 691d59c): the host slowed between
    # rounds, and DynaRL's key ran first in the one round that was slow for the others.
    walls = {
        "fifo": [12.89, 13.62, 17.35, 17.79, 19.16],
        "fifo-aa": [12.71, 14.41, 18.28, 17.65, 18.35],
        "dynarl": [12.06, 12.85, 14.05, 17.64, 18.38],
    }
    paired = moving.paired_gain(walls, "fifo", "dynarl")
    assert paired == pytest.approx(13.62 / 12.85 - 1.0)  # round 2's is the median ratio
    assert paired < 17.35 / 14.05 - 1.0  # the ratio of medians: +23.5%
    # The A/A spread: round 2's pair, the furthest apart.
    assert moving.aa_noise(walls) == pytest.approx((14.41 - 13.62) / ((14.41 + 13.62) / 2))


def test_rounds_of_unequal_length_are_refused(moving: ModuleType) -> None:
    with pytest.raises(ValueError, match="zip"):
        moving.paired_gain({"fifo": [1.0, 2.0], "dynarl": [1.0]}, "fifo", "dynarl")
