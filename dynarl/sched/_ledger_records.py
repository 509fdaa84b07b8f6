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
  utilization plots and of predicted-versus-measured throughput;
- :class:`RoundsRecord`: a run of consecutive uncommitted decision rounds (a job that holds
  for an hour holds every round) written as one line, losslessly: the rounds differ only
  in their id, time, reason and predicted throughputs, which it keeps per round.
  :func:`joins_rounds` says whether a round may join a run, :func:`fold_rounds` writes a run,
  :meth:`RoundsRecord.rounds` gives the rounds back exactly;
- :class:`GraphFindingRecord`: a difference, found when a job starts, between the
  components the job declares and the pipeline graph read from its roles' code (a role the
  code sends to that the job does not run, or a declared component no channel reaches);
- :data:`LedgerRecord`: the union of every record type a ledger holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from dynarl.bus import DecisionReason, DecisionRecord, MigrationRecord

__all__ = [
    "ComponentObservation",
    "GraphFindingRecord",
    "LedgerRecord",
    "ObservationRecord",
    "RoundsRecord",
    "SafeModeRecord",
    "fold_rounds",
    "joins_rounds",
]

_PACK = msgspec.msgpack.Encoder()


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


class GraphFindingRecord(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One finding of a job's start-up graph check (declared components against the graph
    read from their roles' code); a warning, never an error."""

    record_id: str
    """Unique id (``g000001``, ...)."""
    time: float
    """Job-clock time of the check, seconds."""
    finding: Literal["undeclared", "unused"]
    """``undeclared``: the code sends between a declared component and ``component``, which
    the job does not declare; ``unused``: ``component`` is declared but no channel of the
    code reaches it or leaves it."""
    component: str
    """The undeclared role, or the unused declared component."""
    src: str = ""
    """Producer of the undeclared edge ("" for ``unused``)."""
    dst: str = ""
    """Consumer of the undeclared edge ("" for ``unused``)."""
    channel: str = ""
    """Channel of the undeclared edge ("" for ``unused``)."""
    sites: tuple[str, ...] = ()
    """``file:line`` of the puts and gets behind it (of the class, for ``unused``)."""


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


class RoundsRecord(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Consecutive uncommitted decision rounds as one ledger line (see the module).

    Round ``i`` is :attr:`first` with ``decision_ids[i]``, ``times[i]`` and, where the
    column is not empty, ``reasons[i]``, ``throughput_old[i]`` and ``throughput_new[i]``.
    """

    first: DecisionRecord
    """The run's first round, as it was recorded."""
    decision_ids: tuple[str, ...]
    """Every round's id, in order (the first's included)."""
    times: tuple[float, ...]
    """Every round's job-clock time, seconds."""
    reasons: tuple[DecisionReason, ...] = ()
    """Every round's reason; empty when every round has the first's."""
    throughput_old: tuple[float, ...] = ()
    """Every round's ``predicted_throughput_old``; empty when every round has the first's."""
    throughput_new: tuple[float, ...] = ()
    """Every round's ``predicted_throughput_new``; empty when every round has the first's."""

    def rounds(self) -> list[DecisionRecord]:
        """The rounds, as they were recorded. Raises ValueError when a column's length
        differs from the number of ids (a damaged line)."""
        num = len(self.decision_ids)
        columns = (self.times, self.reasons, self.throughput_old, self.throughput_new)
        if any(len(c) not in (0, num) for c in columns) or len(self.times) != num:
            raise ValueError(f"RoundsRecord columns differ in length from its {num} ids")
        first = self.first
        return [
            msgspec.structs.replace(
                first,
                decision_id=self.decision_ids[i],
                time=self.times[i],
                reason=self.reasons[i] if self.reasons else first.reason,
                predicted_throughput_old=(
                    self.throughput_old[i]
                    if self.throughput_old
                    else first.predicted_throughput_old
                ),
                predicted_throughput_new=(
                    self.throughput_new[i]
                    if self.throughput_new
                    else first.predicted_throughput_new
                ),
            )
            for i in range(num)
        ]


LedgerRecord = (
    DecisionRecord | MigrationRecord | SafeModeRecord | ObservationRecord | GraphFindingRecord
)
"""Every record type of a ledger (one JSON line each)."""


def joins_rounds(first: DecisionRecord, record: DecisionRecord) -> bool:
    """Whether ``record`` may join the run that ``first`` began: both uncommitted, and
    equal but for the columns of a :class:`RoundsRecord`."""
    if first.committed or record.committed:
        return False
    aligned = msgspec.structs.replace(
        record,
        decision_id=first.decision_id,
        time=first.time,
        reason=first.reason,
        predicted_throughput_old=first.predicted_throughput_old,
        predicted_throughput_new=first.predicted_throughput_new,
    )
    # Bytes, not ==: exact for -0.0 and NaN alike.
    return _PACK.encode(aligned) == _PACK.encode(first)


def fold_rounds(rounds: Sequence[DecisionRecord]) -> DecisionRecord | RoundsRecord:
    """One line for ``rounds`` (each joins the first): a single round as itself, more as a
    :class:`RoundsRecord` (a column left empty when it never differs from the first).
    Raises ValueError for no rounds."""
    if not rounds:
        raise ValueError("fold needs at least one round")
    first = rounds[0]
    if len(rounds) == 1:
        return first
    reasons = tuple(r.reason for r in rounds)
    old = tuple(r.predicted_throughput_old for r in rounds)
    new = tuple(r.predicted_throughput_new for r in rounds)
    return RoundsRecord(
        first=first,
        decision_ids=tuple(r.decision_id for r in rounds),
        times=tuple(r.time for r in rounds),
        reasons=() if _constant(reasons) else reasons,
        throughput_old=() if _constant(old) else old,
        throughput_new=() if _constant(new) else new,
    )


def _constant(values: tuple[float, ...] | tuple[DecisionReason, ...]) -> bool:
    """Every value is the first, bit for bit (a reason's numbers included)."""
    first = _PACK.encode(values[0])
    return all(_PACK.encode(v) == first for v in values)
