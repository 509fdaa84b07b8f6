"""Ledger records of the scheduler's own: safe-mode transitions and per-round observations.

The bus's :class:`~dynarl.bus.DecisionRecord` and :class:`~dynarl.bus.MigrationRecord`
travel between processes; these two never leave the controller, so they live with the
ledger. Both are ``msgspec`` structs tagged like the bus records, so one JSON line of
``events.jsonl`` decodes to exactly one record type.

- :class:`SafeModeRecord`: safe mode was entered or left (and why), so a reader can tell
  how long the allocation stayed frozen without replaying the scheduler;
- :class:`ObservationRecord`: what the scheduler saw of every component at a decision
  round (devices, utilization, queue, measured and predicted throughput), written next to
  the round's :class:`~dynarl.bus.DecisionRecord` under the same id: the raw material of
  utilization plots and of predicted-versus-measured throughput.
"""

from __future__ import annotations

import msgspec

__all__ = ["ComponentObservation", "ObservationRecord", "SafeModeRecord"]


class SafeModeRecord(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Safe mode was entered (``safe``) or left (not ``safe``) at ``time``."""

    record_id: str
    """Unique id (``s000001``, ...)."""
    time: float
    """Job-clock time of the transition, seconds."""
    safe: bool
    """True: safe mode began; False: it ended."""
    reason: str
    """Why it began (failed moves, prediction error, operator) or ended (cool-down, operator)."""
    operator: bool = False
    """The transition was an operator's command."""


class ComponentObservation(msgspec.Struct, frozen=True, kw_only=True):
    """One component at one decision round (its latest report and the predictor's view)."""

    devices: int
    """Devices it held."""
    utilization: float
    """Mean utilization over its workers in the latest report, in [0, 1]."""
    queue_depth: int
    """Items queued at the latest report."""
    throughput: float
    """Measured items per second over the latest report's interval."""
    predicted_throughput: float
    """The predictor's items per second on ``devices`` in the latest state (0: unknown)."""
    remaining: int
    """Items of the iteration not yet completed."""
    iteration: int
    """Iteration of the latest report."""


class ObservationRecord(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Every reporting component as the scheduler saw it at one decision round."""

    record_id: str
    """The id of the round's :class:`~dynarl.bus.DecisionRecord`."""
    time: float
    """Job-clock time of the round, seconds."""
    components: dict[str, ComponentObservation]
    """Per component name; only components that have reported."""
    num_free: int = 0
    """Devices of the job's quota no component held."""
