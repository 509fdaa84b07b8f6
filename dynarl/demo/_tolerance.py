"""Are two training curves the same within statistical noise? (runs that are not bitwise)

The test (:func:`compare_curves`): take the observations of the last ``last_k`` steps
of each run — by default the mean reward of every prompt group (GRPO's independent unit:
samples of one group share a prompt and are correlated, groups are not) — and compare
the two means with Welch's standard error,

    |mean_a − mean_b| ≤ z · sqrt(var_a / n_a + var_b / n_b) + margin,

``var`` the unbiased sample variances. ``z = 3`` keeps the false-alarm rate of two runs
of the same pipeline near 0.3 % under normal noise; ``margin`` (default 0.02 on a 0–1
reward) covers the degenerate case of two runs whose observations have no spread (all
groups solved). The test can fail: a run that learns something else moves its mean by
more than z·SE (see ``tests/unit/test_tolerance.py``: a deliberately broken variant is
rejected for almost every seed of a fixed set, a faithful one accepted). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CurveComparison", "compare_curves", "group_means"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CurveComparison:
    """The outcome of :func:`compare_curves`."""

    mean_a: float
    """Mean of run a's observations over the window."""
    mean_b: float
    """Mean of run b's."""
    n_a: int
    """Run a's observations."""
    n_b: int
    """Run b's."""
    standard_error: float
    """Welch's standard error of the difference."""
    tolerance: float
    """z · SE + margin."""
    within: bool
    """|mean_a − mean_b| ≤ tolerance."""

    @property
    def difference(self) -> float:
        """mean_a − mean_b."""
        return self.mean_a - self.mean_b

    def describe(self) -> str:
        """One line: means, difference and tolerance, verdict."""
        verdict = "within" if self.within else "OUTSIDE"
        return (
            f"{self.mean_a:.3f} vs {self.mean_b:.3f} (n={self.n_a}/{self.n_b}): "
            f"|Δ| = {abs(self.difference):.3f} {verdict} tolerance {self.tolerance:.3f}"
        )


def group_means(rewards: Sequence[float], group_size: int) -> list[float]:
    """Mean reward of each consecutive ``group_size`` samples (a step's prompt groups).

    Raises ValueError unless ``group_size`` divides the number of rewards.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards are not whole groups of {group_size}")
    return [
        sum(rewards[i : i + group_size]) / group_size for i in range(0, len(rewards), group_size)
    ]


def _mean_var(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, var


def compare_curves(
    a: Sequence[Sequence[float]],
    b: Sequence[Sequence[float]],
    *,
    last_k: int,
    z: float = 3.0,
    margin: float = 0.02,
) -> CurveComparison:
    """Compare per-step observations ``a[step]`` and ``b[step]`` over the last ``last_k``
    steps of each (see the module docstring).

    Raises ValueError for ``last_k`` < 1 or beyond either run, an empty window, or a
    negative ``z`` / ``margin``.
    """
    if last_k < 1 or last_k > min(len(a), len(b)):
        raise ValueError(f"last_k must be in [1, {min(len(a), len(b))}], got {last_k}")
    if z < 0 or margin < 0:
        raise ValueError("compare_curves needs z >= 0 and margin >= 0")
    xs = [v for step in a[-last_k:] for v in step]
    ys = [v for step in b[-last_k:] for v in step]
    if not xs or not ys:
        raise ValueError("compare_curves: a window without observations")
    mean_a, var_a = _mean_var(xs)
    mean_b, var_b = _mean_var(ys)
    se = math.sqrt(var_a / len(xs) + var_b / len(ys))
    tolerance = z * se + margin
    return CurveComparison(
        mean_a=mean_a,
        mean_b=mean_b,
        n_a=len(xs),
        n_b=len(ys),
        standard_error=se,
        tolerance=tolerance,
        within=abs(mean_a - mean_b) <= tolerance,
    )
