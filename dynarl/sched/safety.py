"""Safety gates of the scheduler as a pure state machine.

A move may start only when the scheduler is not in safe mode, no move is in flight,
and at least ``min_move_interval_s`` has passed since the last move ended. Safe mode
freezes the last valid allocation (the pipeline runs on statically); it is entered after
``max_failed_moves`` consecutive failed moves, when any component's median relative
prediction error exceeds ``max_prediction_error`` over at least ``num_error_samples``
samples, or on an operator command; it ends after ``safe_mode_cooldown_s`` or on an
operator command. Every transition returns a new :class:`Safety`; nothing here reads a
clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from dynarl.sched.config import SchedulerConfig

__all__ = ["Safety"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Safety:
    """Where the scheduler stands with respect to its safety rules."""

    safe_since: float | None = None
    """When safe mode began (None: not in safe mode)."""
    safe_reason: str = ""
    """Why it is in safe mode."""
    operator_hold: bool = False
    """Safe mode was entered by an operator: only an operator ends it."""
    failures: int = 0
    """Consecutive failed moves."""
    last_move_end: float = -math.inf
    """When the last move (or its failure) was reported."""
    in_flight: str | None = None
    """Decision id of the move being carried out."""

    @property
    def safe(self) -> bool:
        """Whether safe mode is on."""
        return self.safe_since is not None

    def gate(self, now: float, config: SchedulerConfig) -> str | None:
        """Why no move may start at ``now``, or None if one may."""
        if self.safe:
            return f"safe mode: {self.safe_reason}"
        if self.in_flight is not None:
            return f"move {self.in_flight} still in flight"
        wait = self.last_move_end + config.min_move_interval_s - now
        if wait > 0:
            return f"minimum interval between moves: {wait:.3f} s to go"
        return None

    def started(self, decision_id: str) -> Safety:
        """A move was handed to the executor."""
        return replace(self, in_flight=decision_id)

    def finished(self, ok: bool, now: float, config: SchedulerConfig) -> Safety:
        """The move in flight ended; failures may start safe mode."""
        failures = 0 if ok else self.failures + 1
        after = replace(self, in_flight=None, failures=failures, last_move_end=now)
        if failures >= config.max_failed_moves and not after.safe:
            return after.enter(f"{failures} consecutive failed moves", now)
        return after

    def check_errors(
        self, errors: Mapping[str, tuple[float, int]], now: float, config: SchedulerConfig
    ) -> Safety:
        """Enter safe mode if a component's prediction error is beyond the bound."""
        if self.safe:
            return self
        for name, (error, count) in sorted(errors.items()):
            if count >= config.num_error_samples and error > config.max_prediction_error:
                return self.enter(
                    f"prediction error of {name} is {error:.2f} > {config.max_prediction_error}",
                    now,
                )
        return self

    def enter(self, reason: str, now: float, *, operator: bool = False) -> Safety:
        """Start safe mode (a no-op when already in it, unless an operator takes over)."""
        if self.safe and not operator:
            return self
        return replace(self, safe_since=now, safe_reason=reason, operator_hold=operator)

    def tick(self, now: float, config: SchedulerConfig) -> Safety:
        """End safe mode once its cool-down has passed (not an operator's hold)."""
        if self.safe_since is None or self.operator_hold:
            return self
        if now - self.safe_since >= config.safe_mode_cooldown_s:
            return self.leave()
        return self

    def leave(self) -> Safety:
        """End safe mode; the failure count starts over."""
        return replace(self, safe_since=None, safe_reason="", operator_hold=False, failures=0)
