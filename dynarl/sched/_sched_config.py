"""Settings of the decision plane: Stage 1 thresholds, Stage 2 limits, safety, topology,
and how the default predictor fits.

Defaults are the DynaRL paper's (θ = 0.8, U_low = 0.2 inside the 0.1–0.3 plateau, T = 4 s inside
the 2–8 s plateau). Every field is range-checked when the config is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dynarl.errors import ConfigValueError

__all__ = ["Estimator", "PredictorConfig", "SchedulerConfig"]

Estimator = Literal["theil_sen", "huber", "ols"]
"""Slope estimators of the default predictor."""

_GIB = 1 << 30
_OWNER = "SchedulerConfig."
"""How a range error names a field built from Python (a workload file re-names it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """How the scheduler detects donors, evaluates candidates and protects the job."""

    donor_fraction: float = 0.8
    """θ: a component is a donor when at least this fraction of its workers stays idle."""
    util_low: float = 0.2
    """U_low: a worker counts as idle while its utilization is strictly below this."""
    donor_window_s: float = 4.0
    """T: how long a worker must stay below U_low before it counts, seconds."""
    stats_window_s: float = 30.0
    """Length of the sliding window of component figures (queue, throughput, progress)."""
    num_candidates: int = 10
    """Most candidate reallocations Stage 2 evaluates per round (the DynaRL paper uses 3–10)."""
    num_size_points: int = 64
    """Most sizes per component a candidate search looks at (all of them when fewer)."""
    decision_interval_s: float = 1.0
    """Least time between two decision rounds, seconds of the injected clock."""
    min_move_interval_s: float = 10.0
    """Least time between the end of one move and the next committed move, seconds."""
    min_gain_s: float = 0.0
    """A candidate commits only when it saves strictly more than this, net of its cost."""
    max_failed_moves: int = 3
    """Consecutive failed moves that send the scheduler into safe mode."""
    max_prediction_error: float = 0.5
    """Median relative prediction error of any component that sends it into safe mode."""
    num_error_samples: int = 8
    """Prediction errors a component needs before its error can trigger safe mode."""
    safe_mode_cooldown_s: float = 300.0
    """Time safe mode lasts unless an operator ends it earlier, seconds."""
    num_loss_iterations: int = 2
    """k: iterations of realised move effects the loss rule weighs; a component whose moves
    in the last k iterations cost more than they gained (their realised deltas sum above
    zero) is held, neither shrunk nor grown, until its prediction error falls (0: no rule)."""
    release_error_fraction: float = 0.5
    """A held component is released once its median prediction error, over at least
    ``num_error_samples`` reports, is below this fraction of its error when it was held."""
    observe_only: bool = False
    """Decide and record, but never emit a migration command."""
    num_devices_per_node: int = 8
    """Devices per node; tensor-parallel groups never span two nodes."""
    device_memory_bytes: int = 80 * _GIB
    """Memory of one device, for the peak while old and new trainer state coexist."""
    min_quota_devices: int = 0
    """Lower elastic bound of the job's total quota, devices."""
    max_quota_devices: int | None = None
    """Upper elastic bound of the job's total quota, devices (None: unbounded)."""

    def __post_init__(self) -> None:
        _check_range("donor_fraction", self.donor_fraction, 0.0, 1.0, low_open=True)
        _check_range("util_low", self.util_low, 0.0, 1.0)
        for name in ("donor_window_s", "stats_window_s", "decision_interval_s"):
            _check_range(name, getattr(self, name), 0.0, math.inf, low_open=True)
        for name in ("min_move_interval_s", "min_gain_s", "safe_mode_cooldown_s"):
            _check_range(name, getattr(self, name), 0.0, math.inf)
        _check_range("max_prediction_error", self.max_prediction_error, 0.0, math.inf, True)
        _check_int("num_candidates", self.num_candidates, 3, 10)
        _check_int("num_size_points", self.num_size_points, 4, 4096)
        _check_int("max_failed_moves", self.max_failed_moves, 1, 1000)
        _check_int("num_error_samples", self.num_error_samples, 1, 100_000)
        _check_int("num_loss_iterations", self.num_loss_iterations, 0, 1000)
        _check_range("release_error_fraction", self.release_error_fraction, 0.0, 1.0)
        _check_int("num_devices_per_node", self.num_devices_per_node, 1, 1024)
        _check_int("device_memory_bytes", self.device_memory_bytes, 1, 1 << 50)
        _check_int("min_quota_devices", self.min_quota_devices, 0, 1 << 30)
        if self.max_quota_devices is not None:
            _check_int("max_quota_devices", self.max_quota_devices, 1, 1 << 30)
            if self.max_quota_devices < self.min_quota_devices:
                raise ConfigValueError(
                    _OWNER,
                    "{max_quota_devices} is below {min_quota_devices}",
                    max_quota_devices=self.max_quota_devices,
                    min_quota_devices=self.min_quota_devices,
                )
        if self.stats_window_s < self.donor_window_s:
            raise ConfigValueError(
                _OWNER,
                "{stats_window_s} must cover {donor_window_s}",
                stats_window_s=self.stats_window_s,
                donor_window_s=self.donor_window_s,
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictorConfig:
    """How the default predictor fits."""

    estimator: Estimator = "theil_sen"
    """Slope estimator: ``theil_sen`` (default), ``huber`` or ``ols`` (for comparison)."""
    num_online_samples: int = 64
    """Recent measurements kept per component."""
    num_level_samples: int = 5
    """Online samples needed before they set the level instead of the profile."""
    min_exponent: float = 0.05
    """Lower clamp of the fitted exponent."""
    max_exponent: float = 1.0
    """Upper clamp of the fitted exponent (1: never super-linear)."""
    num_error_samples: int = 32
    """Recent prediction errors kept per component."""

    def __post_init__(self) -> None:
        if not 4 <= self.num_online_samples <= 100_000:
            raise ValueError("PredictorConfig.num_online_samples must be in [4, 100000]")
        if not 1 <= self.num_level_samples <= self.num_online_samples:
            raise ValueError("PredictorConfig.num_level_samples must be in [1, num_online]")
        if not 0 < self.min_exponent <= self.max_exponent <= 2.0:
            raise ValueError("PredictorConfig: need 0 < min_exponent <= max_exponent <= 2")
        if self.num_error_samples < 1:
            raise ValueError("PredictorConfig.num_error_samples must be >= 1")


def _check_range(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ConfigValueError(_OWNER, f"{{{name}}} must be a number", **{name: value})
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        rule = f"{{{name}}} must be in {bracket}{low}, {high}]"
        raise ConfigValueError(_OWNER, rule, **{name: value})


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigValueError(_OWNER, f"{{{name}}} must be an int", **{name: value})
    if not low <= value <= high:
        raise ConfigValueError(_OWNER, f"{{{name}}} must be in [{low}, {high}]", **{name: value})
