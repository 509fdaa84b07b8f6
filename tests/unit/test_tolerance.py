"""The curve comparison of non-bitwise runs: it accepts faithful runs and rejects broken ones.

A run is simulated as GRPO's reward curve: per step, prompt groups whose samples are
Bernoulli draws around a per-prompt difficulty, the success probability rising as the
policy learns. A faithful variant (the same pipeline, another seed) must be accepted for
almost every seed of a fixed set; a deliberately broken variant (its updates do not
learn: the probability stays where it started, as with advantages of the wrong sign
cancelling the signal) must be rejected for almost every seed.
"""

from __future__ import annotations

import random

import pytest

from dynarl.demo._tolerance import compare_curves, group_means

NUM_STEPS, NUM_GROUPS, GROUP_SIZE, LAST_K = 6, 8, 8, 3


def simulated_run(seed: int, *, learns: bool) -> list[list[float]]:
    """Per step: the mean reward of each prompt group."""
    rng = random.Random(seed)
    steps = []
    for step in range(NUM_STEPS):
        skill = 0.4 + (0.1 * step if learns else 0.0)
        rewards = []
        for _ in range(NUM_GROUPS):
            p = min(max(skill + rng.gauss(0.0, 0.12), 0.0), 1.0)
            rewards += [float(rng.random() < p) for _ in range(GROUP_SIZE)]
        steps.append(group_means(rewards, GROUP_SIZE))
    return steps


def test_faithful_variants_are_accepted_for_almost_every_seed() -> None:
    accepted = sum(
        compare_curves(
            simulated_run(seed, learns=True),
            simulated_run(10_000 + seed, learns=True),
            last_k=LAST_K,
        ).within
        for seed in range(200)
    )
    assert accepted >= 190


def test_a_broken_variant_is_rejected_for_almost_every_seed() -> None:
    rejected = sum(
        not compare_curves(
            simulated_run(seed, learns=True),
            simulated_run(10_000 + seed, learns=False),
            last_k=LAST_K,
        ).within
        for seed in range(200)
    )
    assert rejected >= 190


def test_identical_curves_are_within_and_a_shift_is_not() -> None:
    run = simulated_run(1, learns=True)
    same = compare_curves(run, run, last_k=LAST_K)
    assert same.within and same.difference == 0.0
    shifted = [[min(1.0, v + 0.3) for v in step] for step in run]
    outcome = compare_curves(run, shifted, last_k=LAST_K)
    assert not outcome.within
    assert "OUTSIDE" in outcome.describe()


def test_no_spread_relies_on_the_margin() -> None:
    ones = [[1.0, 1.0]] * 3
    assert compare_curves(ones, [[0.99, 0.99]] * 3, last_k=2).within
    assert not compare_curves(ones, [[0.9, 0.9]] * 3, last_k=2).within


def test_only_the_window_counts() -> None:
    early_differs = [[0.0, 0.0], [0.5, 0.6], [0.5, 0.6]]
    assert compare_curves(early_differs, [[1.0, 1.0], [0.5, 0.6], [0.6, 0.5]], last_k=2).within


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"last_k": 0}, "last_k"),
        ({"last_k": 4}, "last_k"),
        ({"last_k": 1, "z": -1.0}, "z >= 0"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compare_curves([[1.0]] * 3, [[1.0]] * 3, **kwargs)  # type: ignore[arg-type]


def test_group_means_needs_whole_groups() -> None:
    assert group_means([1.0, 0.0, 1.0, 1.0], 2) == [0.5, 1.0]
    with pytest.raises(ValueError, match="whole groups"):
        group_means([1.0, 0.0, 1.0], 2)
