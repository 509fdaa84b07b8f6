"""The simulator's engine model calibrated on a real engine, and its prediction of a replay.

A profiling pass on the engine (run by the caller: ``bench/priority.py`` does it on vLLM)
gives decode points — a step's seconds at a batch size and the KV tokens it holds — and
prefill points — seconds to prefill a prompt of some length, against a baseline that
generated one token less. :meth:`EngineProfile.fit` turns them into a
:class:`~dynarl.sim.RolloutSpec`: the step curve ``t0 + c_seq·b + c_kv·KV`` by least squares
(a coefficient the data drives negative is dropped and the rest refitted), the prefill speed
as the slope of seconds over tokens, and the serving stack's round trip per request (what a
one-token request takes beyond one decode step). :func:`spec_digest` names the frozen
result, so a run can show that its predictions came from a model fixed before any
measurement they are compared with.

:func:`replay_rollout` runs one iteration's trace alone on a workload's rollout engines —
every episode, turns, tool waits and the prefix cache as in a full simulation — with a given
request policy, and reports its time and cache figures. Pure computation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from dynarl.errors import DynarlError
from dynarl.sched import RequestPolicy
from dynarl.sim._event_loop import EventLoop
from dynarl.sim._rollout import Rollout
from dynarl.sim._specs import RolloutSpec
from dynarl.sim._trace import IterationTrace
from dynarl.sim._workload_file import Workload

__all__ = [
    "DecodePoint",
    "EngineProfile",
    "PrefillPoint",
    "RolloutReplay",
    "replay_rollout",
    "spec_digest",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodePoint:
    """One decode measurement."""

    batch: int
    """Requests decoding together."""
    kv_tokens: float
    """KV tokens they held on average over the measured steps."""
    step_s: float
    """Seconds per decode step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillPoint:
    """One prefill measurement."""

    tokens: int
    """Prompt tokens prefilled."""
    seconds: float
    """Seconds the prefill added over a request without that prompt."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineProfile:
    """A profiling pass's points (see the module docstring)."""

    decode: tuple[DecodePoint, ...]
    """At least three, at two batch sizes or more."""
    prefill: tuple[PrefillPoint, ...]
    """At least two, at two prompt lengths or more."""
    round_trip_s: float = 0.0
    """Seconds from submitting a one-token request with a tiny prompt to its output, as the
    caller sees it (0: not measured)."""

    def __post_init__(self) -> None:
        if len(self.decode) < 3 or len({p.batch for p in self.decode}) < 2:
            raise ValueError("EngineProfile needs >= 3 decode points at >= 2 batch sizes")
        if len(self.prefill) < 2 or len({p.tokens for p in self.prefill}) < 2:
            raise ValueError("EngineProfile needs >= 2 prefill points at >= 2 prompt lengths")
        if any(p.step_s <= 0 or p.batch < 1 or p.kv_tokens < 0 for p in self.decode):
            raise ValueError("decode points need step_s > 0, batch >= 1, kv_tokens >= 0")
        if self.round_trip_s < 0:
            raise ValueError(f"round_trip_s must be >= 0, got {self.round_trip_s}")

    def step_coefficients(self) -> tuple[float, float, float]:
        """``(t0, c_seq, c_kv)`` of the decode step, each >= 0 (``t0`` > 0)."""
        x = np.array([[1.0, p.batch, p.kv_tokens] for p in self.decode])
        y = np.array([p.step_s for p in self.decode])
        keep = [0, 1, 2]
        while True:
            coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            negative = [k for k, c in zip(keep[1:], coef[1:], strict=True) if c < 0]
            if not negative:
                break
            keep.remove(negative[0])
        out = [0.0, 0.0, 0.0]
        for k, c in zip(keep, coef, strict=True):
            out[k] = float(c)
        if out[0] <= 0:
            out[0] = float(min(y))  # the step never took less than its smallest measurement
        return out[0], out[1], out[2]

    def prefill_tokens_per_s(self) -> float:
        """Prefill speed: the slope of seconds over tokens (ValueError unless positive)."""
        tokens = np.array([float(p.tokens) for p in self.prefill])
        seconds = np.array([p.seconds for p in self.prefill])
        slope = float(np.polyfit(tokens, seconds, 1)[0])
        if slope <= 0:
            raise ValueError(f"prefill seconds do not grow with prompt tokens (slope {slope})")
        return 1.0 / slope

    def fit(self, base: RolloutSpec) -> RolloutSpec:
        """``base`` (capacity, admission, cache granularity: the engine's configuration) with
        the step curve and the prefill speed measured here."""
        t0, c_seq, c_kv = self.step_coefficients()
        speed = self.prefill_tokens_per_s()
        return replace(
            base,
            step_fixed_s=t0,
            step_per_seq_s=c_seq,
            step_per_kv_token_s=c_kv,
            prefill_tokens_per_s=speed,
            request_overhead_s=max(0.0, self.round_trip_s - t0 - c_seq - c_kv),
        )

    def to_dict(self) -> dict[str, Any]:
        """The points as plain data (for a run's record)."""
        return {
            "decode": [asdict(p) for p in self.decode],
            "prefill": [asdict(p) for p in self.prefill],
            "round_trip_s": self.round_trip_s,
        }


def spec_digest(spec: RolloutSpec) -> str:
    """SHA-256 (16 hex digits) of every field of ``spec``: the frozen model's name."""
    text = json.dumps(asdict(spec), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutReplay:
    """What the simulated engines did with one trace."""

    iteration_s: float
    """Seconds from the first submission to the last episode's end."""
    hit_rate: float
    """Cached share of the prompt tokens admitted (partial outputs included)."""
    reprefill_tokens: int
    """Tokens prefilled again though computed before (evicted or retracted)."""
    prefill_tokens: int
    """Tokens prefilled."""
    retractions: int
    """Requests retracted (vLLM: preempted) for KV room."""


def replay_rollout(
    workload: Workload,
    trace: IterationTrace,
    policy: RequestPolicy,
    *,
    num_gpus: int | None = None,
    max_events: int = 5_000_000,
) -> RolloutReplay:
    """Run ``trace`` alone on ``workload``'s rollout engines over ``num_gpus`` devices (one
    engine's TP by default), ``policy`` ordering every engine's queue. Raises DynarlError
    when the trace does not finish within ``max_events`` events."""
    loop = EventLoop()
    left = [trace.num_samples]

    def done(_: int, __: int) -> None:
        left[0] -= 1
        if left[0] == 0:
            loop.stop()

    rollout = Rollout(workload, loop, lambda: policy, done)
    rollout.add_devices(range(num_gpus or workload.rollout.tp))
    rollout.start(trace)
    loop.run(until=1e9, max_events=max_events)
    if left[0]:  # the event queue ran dry: nothing will finish them
        raise DynarlError(f"the replay left {left[0]} episodes unfinished")
    engines: Sequence[Any] = list(rollout.engines.values())
    admitted = sum(e.admitted_tokens for e in engines)
    return RolloutReplay(
        iteration_s=loop.now,
        hit_rate=sum(e.hit_tokens for e in engines) / admitted if admitted else 0.0,
        reprefill_tokens=sum(e.reprefill_tokens for e in engines),
        prefill_tokens=sum(e.prefill_tokens for e in engines),
        retractions=sum(e.num_retractions for e in engines),
    )
