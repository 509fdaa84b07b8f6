"""Throughput predictors: the protocol Stage 2 calls, and a robust regression default.

The default models a component's throughput (items per second) on ``n`` devices as

    f(n, R) = a · n_eff ** b,   n_eff = n · s / (n + s),   s = R / q

where R is the iteration's remaining items and q the items one device keeps busy (the
profile's ``items_per_device``). With plenty of work n_eff ≈ n and f is a power law,
concave for b ≤ 1; as R shrinks n_eff saturates at s and f flattens in n (the rollout
tail). Without a ``q`` (the trainer) n_eff = n and f is near-linear when fed. The slope b
comes from a Theil–Sen fit (median of pairwise slopes, pairs taken within the offline
profile and within the online window, never across them, so a level drift does not bend
it); the level a from the median log-ratio of the recent online measurements
(breakdown point 50%), falling back to the profile. :meth:`observe` is O(1) and records
the prediction error before learning from a sample; :meth:`refit` does the fitting,
outside the decision path. Online samples and errors are kept per iteration (the
report's ``iteration``): a new iteration restarts them from the profile level.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from dynarl.bus import ComponentReport
from dynarl.sched._sched_config import Estimator, PredictorConfig

__all__ = [
    "ComponentProfile",
    "ProfilePoint",
    "RegressionPredictor",
    "ThroughputPredictor",
    "fit_power_law",
]

FloatArray = npt.NDArray[np.float64]


@runtime_checkable
class ThroughputPredictor(Protocol):
    """Predicts each component's throughput from its devices and state.

    The scheduler calls :meth:`predict` inside decisions (it must be fast and must not
    learn), :meth:`observe` for every report, and :meth:`refit` between decisions.
    """

    def predict(
        self, component: str, num_devices: FloatArray, state: ComponentReport
    ) -> FloatArray:
        """Throughput in items/s for each device count, given the component's latest state."""
        ...

    def observe(self, component: str, num_devices: int, state: ComponentReport) -> None:
        """Learn from a measured report (``state.throughput`` on ``num_devices``)."""
        ...

    def refit(self) -> None:
        """Fold the observations since the last refit into the models."""
        ...

    def prediction_error(self, component: str) -> tuple[float, int]:
        """Median relative error of recent predictions for ``component``, and sample count."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfilePoint:
    """One offline measurement."""

    num_devices: int
    """Devices the component had."""
    throughput: float
    """Measured items per second."""
    remaining: int | None = None
    """Remaining items when measured (None: plenty)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ComponentProfile:
    """What is known about a component before the job runs."""

    points: tuple[ProfilePoint, ...] = ()
    """Offline profile measurements (batch size / sequence length representative points)."""
    items_per_device: float = 0.0
    """Items one device keeps busy (rollout: concurrent requests per device); 0: no tail."""
    exponent: float = 1.0
    """Exponent b assumed until measurements give one."""

    def __post_init__(self) -> None:
        if self.items_per_device < 0 or self.exponent <= 0:
            raise ValueError("ComponentProfile: items_per_device >= 0 and exponent > 0 required")
        for p in self.points:
            if p.num_devices < 1 or p.throughput <= 0:
                raise ValueError(f"ComponentProfile: bad point {p}")


def effective_devices(num_devices: FloatArray, remaining: float | None, q: float) -> FloatArray:
    """n_eff = n·s/(n+s) with s = remaining/q; n itself when there is no tail model."""
    if q <= 0 or remaining is None:
        return num_devices
    s = max(remaining, 0.0) / q
    if s <= 0:
        return np.zeros_like(num_devices)
    return num_devices * s / (num_devices + s)


def fit_power_law(
    groups: list[tuple[FloatArray, FloatArray]], estimator: Estimator = "theil_sen"
) -> float | None:
    """Slope of log y on log x, pooled over ``groups`` of (x, y) (no cross-group pairs).

    Returns None when no group has two distinct x.
    """
    xs, ys = [], []
    for x, y in groups:
        keep = (x > 0) & (y > 0)
        xs.append(np.log(x[keep]))
        ys.append(np.log(y[keep]))
    if estimator == "theil_sen":
        slopes = []
        for lx, ly in zip(xs, ys, strict=True):
            i, j = np.triu_indices(lx.shape[0], k=1)
            dx = lx[j] - lx[i]
            ok = np.abs(dx) > 1e-9
            slopes.append((ly[j] - ly[i])[ok] / dx[ok])
        pooled = np.concatenate(slopes) if slopes else np.empty(0)
        return float(np.median(pooled)) if pooled.size else None
    # Least squares on per-group centred data (removes each group's level).
    cx = np.concatenate([lx - lx.mean() for lx in xs if lx.size]) if xs else np.empty(0)
    cy = np.concatenate([ly - ly.mean() for ly in ys if ly.size]) if ys else np.empty(0)
    if cx.size < 2 or float(np.dot(cx, cx)) < 1e-12:
        return None
    slope = float(np.dot(cx, cy) / np.dot(cx, cx))
    if estimator == "ols":
        return slope
    for _ in range(20):  # Huber IRLS
        resid = cy - slope * cx
        scale = 1.4826 * float(np.median(np.abs(resid - np.median(resid)))) or 1e-6
        weights = np.minimum(1.0, 1.345 * scale / np.maximum(np.abs(resid), 1e-12))
        denom = float(np.dot(weights * cx, cx))
        if denom < 1e-12:
            break
        slope = float(np.dot(weights * cx, cy) / denom)
    return slope


@dataclass(slots=True)
class _Model:
    profile: ComponentProfile
    log_level: float = 0.0
    exponent: float = 1.0
    fitted: bool = False
    online: deque[tuple[float, float, float]] = field(default_factory=deque)
    errors: deque[float] = field(default_factory=deque)
    dirty: bool = True
    iteration: int | None = None


class RegressionPredictor:
    """The default :class:`ThroughputPredictor` (see the module docstring).

    A component with neither profile points nor enough observations predicts 0, so it is
    never chosen to receive devices on a guess. Not thread-safe; lives in the
    scheduler's loop.
    """

    def __init__(
        self,
        profiles: Mapping[str, ComponentProfile] | None = None,
        config: PredictorConfig | None = None,
    ) -> None:
        self._config = config or PredictorConfig()
        self._models: dict[str, _Model] = {}
        for name, profile in (profiles or {}).items():
            self._models[name] = self._new_model(profile)
        self.refit()

    def _new_model(self, profile: ComponentProfile) -> _Model:
        model = _Model(profile=profile, exponent=profile.exponent)
        model.online = deque(maxlen=self._config.num_online_samples)
        model.errors = deque(maxlen=self._config.num_error_samples)
        return model

    def predict(
        self, component: str, num_devices: FloatArray, state: ComponentReport
    ) -> FloatArray:
        """Predicted items/s per device count (0 for an unknown or unfitted component)."""
        n = np.asarray(num_devices, dtype=np.float64)
        model = self._models.get(component)
        if model is None or not model.fitted:
            return np.zeros_like(n)
        q = model.profile.items_per_device
        n_eff = effective_devices(n, float(state.remaining), q)
        with np.errstate(divide="ignore"):
            out = np.exp(model.log_level) * np.power(n_eff, model.exponent)
        return np.where(n > 0, out, 0.0)

    def observe(self, component: str, num_devices: int, state: ComponentReport) -> None:
        """Record the error of the current prediction, then keep the sample for refitting.

        Samples of a component without a tail model that had nothing queued are starved
        (their throughput says nothing about capacity) and are skipped.
        """
        if num_devices <= 0 or state.throughput <= 0:
            return
        model = self._models.get(component)
        if model is None:
            model = self._models[component] = self._new_model(ComponentProfile())
        if model.profile.items_per_device <= 0 and state.queue_depth == 0:
            return
        if model.iteration is not None and state.iteration != model.iteration:
            # A new iteration starts a new regime (a rollout tail's measurements say
            # nothing about the next batch's start): the model falls back to the
            # profile until the new iteration's samples arrive.
            model.online.clear()
            model.errors.clear()
            self._fit(model)
        model.iteration = state.iteration
        if model.fitted:
            predicted = float(self.predict(component, np.array([num_devices]), state)[0])
            model.errors.append(abs(predicted - state.throughput) / state.throughput)
        n_eff = effective_devices(
            np.array([float(num_devices)]), float(state.remaining), model.profile.items_per_device
        )
        model.online.append((float(n_eff[0]), state.throughput, float(num_devices)))
        model.dirty = True

    def prediction_error(self, component: str) -> tuple[float, int]:
        """(median relative error, number of errors recorded) for ``component``."""
        model = self._models.get(component)
        if model is None or not model.errors:
            return 0.0, 0
        return float(np.median(np.fromiter(model.errors, dtype=np.float64))), len(model.errors)

    def refit(self) -> None:
        """Refit every component that got samples since its last fit."""
        for model in self._models.values():
            if model.dirty:
                self._fit(model)
                model.dirty = False

    def _fit(self, model: _Model) -> None:
        cfg = self._config
        q = model.profile.items_per_device
        prof = model.profile.points
        px = np.array(
            [effective_devices(np.array([float(p.num_devices)]), _rem(p), q)[0] for p in prof]
        )
        py = np.array([p.throughput for p in prof])
        online = list(model.online)
        ox = np.array([o[0] for o in online])
        oy = np.array([o[1] for o in online])
        slope = fit_power_law([(px, py), (ox, oy)], cfg.estimator)
        if slope is not None and math.isfinite(slope):
            model.exponent = min(max(slope, cfg.min_exponent), cfg.max_exponent)
        recent = (ox, oy) if ox.size >= cfg.num_level_samples else (px, py)
        x, y = recent
        keep = (x > 0) & (y > 0)
        if not keep.any():
            return
        ratios = np.log(y[keep]) - model.exponent * np.log(x[keep])
        model.log_level = float(np.median(ratios))
        model.fitted = True


def _rem(point: ProfilePoint) -> float | None:
    return None if point.remaining is None else float(point.remaining)
