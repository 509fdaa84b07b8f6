"""Offline profiling: what a user measures before the job, as the baselines use it.

- :func:`stage_times`: per-component time of one iteration's work on ``n`` GPUs
  (rollout: a rollout-only simulation of iteration 0; inference and trainer: work over
  throughput), at a few GPU counts.
- :func:`fit_time_curve`: RLinf's auto-placement fits GPU→time with power-law,
  exponential, logarithmic and quadratic curves and keeps the best R².
- :func:`best_partition`: the static disaggregated partition with the least predicted
  iteration time (the slowest pipelined stage), over every feasible split.
- :func:`start_partition`: where a dynamic policy's synchronous iteration starts: only
  rollout has work at the barrier, so the others hold their minimum (a parkable trainer
  none) and rollout the rest.
- :func:`predictor_profiles`: the profile points dynarl's predictor starts from
  (representative batch size and sequence length, the way the DynaRL paper profiles).

Rollout profiles are cached per rollout-relevant part of the workload, so sweeps over
scheduler parameters do not re-profile. Pure apart from that cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dynarl.sched import ComponentProfile, FifoPolicy, ProfilePoint
from dynarl.sim._event_loop import EventLoop
from dynarl.sim._rollout import Rollout
from dynarl.sim._trace import build_trace
from dynarl.sim._workload_file import Workload

__all__ = [
    "TimeCurve",
    "best_partition",
    "fit_time_curve",
    "predictor_profiles",
    "rlinf_dp_sizes",
    "rollout_alone",
    "rollout_time",
    "stage_times",
    "start_partition",
]

_ROLLOUT_CACHE: dict[tuple[object, ...], float] = {}


def rollout_alone(
    workload: Workload, num_gpus: int, iteration: int = 0
) -> tuple[EventLoop, Rollout]:
    """An event loop with ``iteration``'s rollout started alone (FIFO) on ``num_gpus``
    devices; the loop stops when the batch's last sample is done. Run it with ``loop.run``."""
    loop = EventLoop()
    left = [workload.batch.num_samples]

    def done(_: int, __: int) -> None:
        left[0] -= 1
        if left[0] == 0:
            loop.stop()

    rollout = Rollout(workload, loop, FifoPolicy, done)
    rollout.add_devices(range(num_gpus))
    rollout.start(build_trace(workload, iteration))
    return loop, rollout


def rollout_time(workload: Workload, num_gpus: int, iteration: int = 0) -> float:
    """Seconds rollout alone takes to finish one iteration's batch on ``num_gpus``."""
    w = workload
    key = (w.rollout, w.batch, w.lengths, w.agentic, w.seed, w.cluster, num_gpus, iteration)
    if key in _ROLLOUT_CACHE:
        return _ROLLOUT_CACHE[key]
    loop, _ = rollout_alone(w, num_gpus, iteration)
    loop.run(until=1e7, max_events=400 * w.batch.num_samples * 16)
    _ROLLOUT_CACHE[key] = loop.now
    return loop.now


def _mean_tokens(workload: Workload) -> float:
    return float(build_trace(workload, 0).total_tokens.mean())


def stage_times(workload: Workload, name: str, sizes: Sequence[int]) -> list[float]:
    """Time of one iteration's work for component ``name`` at each GPU count."""
    if name == "rollout":
        return [rollout_time(workload, n) for n in sizes]
    spec = workload.inference if name == "inference" else workload.trainer
    work = _mean_tokens(workload) * workload.batch.num_samples
    return [work / spec.rate(n) for n in sizes]


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeCurve:
    """A fitted GPU→time curve."""

    family: str
    """``power``, ``exponential``, ``log`` or ``quadratic``."""
    coefficients: tuple[float, ...]
    r2: float
    """Coefficient of determination on the profile points."""

    def __call__(self, n: float) -> float:
        """Predicted seconds on ``n`` GPUs."""
        c = self.coefficients
        if self.family == "power":
            return float(c[0] * n ** c[1])
        if self.family == "exponential":
            return c[0] * math.exp(c[1] * n)
        if self.family == "log":
            return c[0] + c[1] * math.log(n)
        return c[0] + c[1] * n + c[2] * n * n


def fit_time_curve(sizes: Sequence[int], times: Sequence[float]) -> TimeCurve:
    """Fit all four families; the best R² wins (raises ValueError with < 3 points)."""
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if x.shape[0] < 3:
        raise ValueError("fit_time_curve needs at least 3 profile points")
    fits: list[TimeCurve] = []
    b, a = np.polyfit(np.log(x), np.log(y), 1)
    fits.append(TimeCurve(family="power", coefficients=(math.exp(a), b), r2=0.0))
    b, a = np.polyfit(x, np.log(y), 1)
    fits.append(TimeCurve(family="exponential", coefficients=(math.exp(a), b), r2=0.0))
    b, a = np.polyfit(np.log(x), y, 1)
    fits.append(TimeCurve(family="log", coefficients=(a, b), r2=0.0))
    c2, c1, c0 = np.polyfit(x, y, 2)
    fits.append(TimeCurve(family="quadratic", coefficients=(c0, c1, c2), r2=0.0))
    total = float(((y - y.mean()) ** 2).sum()) or 1e-12
    scored = []
    for fit in fits:
        pred = np.array([fit(v) for v in x])
        r2 = 1.0 - float(((y - pred) ** 2).sum()) / total
        scored.append(TimeCurve(family=fit.family, coefficients=fit.coefficients, r2=r2))
    return max(scored, key=lambda f: f.r2)


def rlinf_dp_sizes(workload: Workload) -> tuple[int, ...]:
    """RLinf's valid trainer DP sizes: (batch × group / n_mb) divisible by (dp × group)."""
    b = workload.batch
    per_step = b.num_samples // b.num_minibatches
    max_dp = workload.cluster.num_gpus // workload.trainer.tp
    return tuple(d for d in range(1, max_dp + 1) if per_step % (d * b.group_size) == 0)


def _profile_sizes(total: int, unit: int) -> list[int]:
    raw = {unit, total // 8, total // 4, total // 2, (3 * total) // 4, total}
    return sorted({max(unit, (n // unit) * unit) for n in raw})


def best_partition(workload: Workload, *, rlinf_sizes: bool = True) -> dict[str, int]:
    """The fixed (rollout, inference, trainer) split with the least predicted iteration time.

    Each component's profile is fitted (:func:`fit_time_curve`); a split's time is its
    slowest stage (stages pipeline). The trainer keeps RLinf's valid DP sizes when
    ``rlinf_sizes``. Raises ValueError when no split is feasible.
    """
    w = workload
    total = w.cluster.num_gpus
    units = {"rollout": w.rollout.tp, "inference": w.inference.tp, "trainer": w.trainer.tp}
    curves: dict[str, Callable[[float], float]] = {}
    for name, unit in units.items():
        sizes = _profile_sizes(total, unit)
        curves[name] = fit_time_curve(sizes, stage_times(w, name, sizes))
    dps = set(rlinf_dp_sizes(w)) if rlinf_sizes else None
    lo_t = max(w.trainer.min_gpus, w.trainer.tp)
    best: tuple[float, dict[str, int]] | None = None
    for t in range(lo_t, total, w.trainer.tp):
        if dps is not None and t // w.trainer.tp not in dps:
            continue
        for i in range(max(w.inference.min_gpus, w.inference.tp), total - t, w.inference.tp):
            r = total - t - i
            r -= r % w.rollout.tp
            if r < w.rollout.tp:
                continue
            time = max(curves["rollout"](r), curves["inference"](i), curves["trainer"](t))
            if best is None or time < best[0]:
                best = (time, {"rollout": r, "inference": i, "trainer": t})
    if best is None:
        raise ValueError(f"{w.name}: no feasible static partition")
    return best[1]


def start_partition(workload: Workload) -> dict[str, int]:
    """The iteration-start allocation of a synchronous dynamic policy.

    At the barrier only rollout has work: inference and the trainer wait for its first
    groups. So they start small — the trainer at the fewest devices that hold its state,
    inference at its own minimum — and rollout holds the rest, as the DynaRL paper's timeline
    shows (inference and the trainer grow as rollout's tail frees devices). Each starts
    with at least one replica: every stage has work in every iteration, and an allocation
    in which one has none runs only if the scheduler moves devices to it, which it does
    not in safe mode or ``observe_only`` (the iteration would never end).

    A parkable trainer (``[trainer] parkable``: its state waits in host memory) starts
    parked at 0, and so does inference when its minimum is 0: rollout then holds every
    device, and the policy's pipeline rule (:class:`~dynarl.sim.policies.DynarlPolicy`)
    unparks a stage that still holds nothing once rollout is done.
    """
    w = workload
    trainer = max(w.trainer.min_gpus, w.trainer.tp)
    inference = max(w.inference.min_gpus, w.inference.tp)
    if w.trainer.parkable:
        trainer = 0
        inference = w.inference.min_gpus
    rollout = w.cluster.num_gpus - trainer - inference
    rollout -= rollout % w.rollout.tp
    if rollout < w.rollout.tp:
        raise ValueError(f"{w.name}: no devices left for rollout at the iteration start")
    return {"rollout": rollout, "inference": inference, "trainer": trainer}


def predictor_profiles(workload: Workload) -> dict[str, ComponentProfile]:
    """Profile points (items/s at representative batch and sequence length) per component.

    Rollout: with a decode step of ``t0 + c·b`` (``c`` the per-request cost at the mean
    KV per request), ``R`` requests on ``n`` GPUs complete at
    ``(1 / (c·tp·L)) · n·s / (n + s)`` items/s with ``s = R·c·tp / t0`` — exactly the
    predictor's tail model with ``items_per_device = t0 / (c·tp)`` (L: mean output
    tokens). Inference and trainer: throughput over the mean sample length.
    """
    w = workload
    trace = build_trace(w, 0)
    mean_out = float(trace.output_tokens.mean())
    mean_total = float(trace.total_tokens.mean())
    mean_kv = float(trace.prompt.mean()) + mean_out / 2.0
    spec = w.rollout
    per_request = spec.step_per_seq_s + spec.step_per_kv_token_s * mean_kv
    level = 1.0 / (per_request * spec.tp * mean_out)
    total = w.cluster.num_gpus
    out = {
        "rollout": ComponentProfile(
            points=tuple(
                ProfilePoint(num_devices=n, throughput=level * n)
                for n in _profile_sizes(total, spec.tp)
            ),
            items_per_device=spec.step_fixed_s / (per_request * spec.tp),
        )
    }
    for name, stage in (("inference", w.inference), ("trainer", w.trainer)):
        if stage.fused:
            out[name] = ComponentProfile()  # no devices to decide for it
            continue
        out[name] = ComponentProfile(
            points=tuple(
                ProfilePoint(num_devices=n, throughput=stage.rate(n) / mean_total)
                for n in _profile_sizes(total, stage.tp)
            ),
            exponent=stage.scaling_exponent,
        )
    return out
