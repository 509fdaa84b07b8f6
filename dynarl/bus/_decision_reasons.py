"""Why a decision round did what it did: one tagged struct per reason.

A :class:`~dynarl.bus.DecisionRecord` carries one :data:`DecisionReason` and each of its
:class:`~dynarl.bus.RejectedCandidate` s one :data:`CandidateReason`. They are wire structs
like the records (``tag=True``: the class name in the ``"type"`` field), so a reader
dispatches on the type and reads numbers from fields, never from text. Each renders the
sentence the ledger has always shown (``str(reason)``) and names its :attr:`category`:
the sentence without its numbers and ids, which the ledger summary counts by.

- holds, before Stage 2: :class:`NoDonor`, :class:`SafeMode`, :class:`MoveInFlight`,
  :class:`MinimumInterval` (:data:`HoldReason`);
- quota changes: :class:`QuotaRefused`, :class:`Reclaim`;
- Stage 2: :class:`Commit`, :class:`Rejected` (with its :data:`RejectionReason`),
  :class:`ObserveOnly` (a commit that observe-only mode did not carry out);
- per candidate: :class:`NotBetterAfterCost`, :class:`SavesLess`, :class:`FinishesLater`,
  :class:`InfeasiblePlacement`; per round with no candidate: :class:`NoMovableDonor`,
  :class:`NoFeasibleReduction`;
- :class:`LegacyReason`: a reason read from a ledger written before reasons were typed
  whose text matches none of the above, kept verbatim.
"""

from __future__ import annotations

import math
import re
from typing import ClassVar, Literal

import msgspec

__all__ = [
    "CandidateReason",
    "Commit",
    "DecisionReason",
    "FinishesLater",
    "HoldReason",
    "InfeasiblePlacement",
    "LegacyReason",
    "MinimumInterval",
    "MoveInFlight",
    "NoDonor",
    "NoFeasibleReduction",
    "NoMovableDonor",
    "NotBetterAfterCost",
    "ObserveOnly",
    "QuotaRefused",
    "Reclaim",
    "Rejected",
    "RejectionReason",
    "SafeMode",
    "SavesLess",
]

Family = Literal["hold", "quota", "commit", "rejected", "observe-only", "candidate", "other"]
"""What kind of outcome a reason explains (``candidate``: one candidate's rejection)."""

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|inf|nan)\b|\b[a-z]+\d{3,}\b")


def _prose_category(text: str) -> str:
    """A sentence's category: its numbers and ids as ``#``, cut after its first clause
    (after its second for ``hold:`` and ``rejected:``)."""
    parts = text.split(": ")
    head = ": ".join(parts[:2]) if parts[0] in ("hold", "rejected") else parts[0]
    return _NUMBER.sub("#", head).strip()


class _Reason(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    family: ClassVar[Family] = "other"
    """Which kind of outcome the reason explains (the metrics exporter's ``result``)."""

    @property
    def category(self) -> str:
        """The reason without its numbers and ids (what the ledger summary counts by)."""
        raise NotImplementedError


# ---------------------------------------------------------------------- holds


class NoDonor(_Reason, frozen=True, kw_only=True):
    """No component idled long enough to give devices up, and none are free."""

    family: ClassVar[Family] = "hold"

    def __str__(self) -> str:
        return "hold: no donor"

    @property
    def category(self) -> str:
        return "hold: no donor"


class SafeMode(_Reason, frozen=True, kw_only=True):
    """The scheduler is in safe mode (the allocation is frozen)."""

    family: ClassVar[Family] = "hold"
    why: str
    """Why safe mode began (failed moves, prediction error, an operator's reason)."""

    def __str__(self) -> str:
        return f"hold: safe mode: {self.why}"

    @property
    def category(self) -> str:
        return "hold: safe mode"


class MoveInFlight(_Reason, frozen=True, kw_only=True):
    """An earlier move is still being carried out."""

    family: ClassVar[Family] = "hold"
    decision_id: str
    """The decision whose move is in flight."""

    def __str__(self) -> str:
        return f"hold: move {self.decision_id} still in flight"

    @property
    def category(self) -> str:
        return "hold: move # still in flight"


class MinimumInterval(_Reason, frozen=True, kw_only=True):
    """Too little time has passed since the last move ended."""

    family: ClassVar[Family] = "hold"
    wait_s: float
    """Seconds until the next move may start."""

    def __str__(self) -> str:
        return f"hold: minimum interval between moves: {self.wait_s:.3f} s to go"

    @property
    def category(self) -> str:
        return "hold: minimum interval between moves"


# ---------------------------------------------------------------------- quota


class QuotaRefused(_Reason, frozen=True, kw_only=True):
    """A cluster quota change was refused; nothing moved."""

    family: ClassVar[Family] = "quota"
    detail: str
    """The quota planner's explanation, as it gives it."""

    def __str__(self) -> str:
        return self.detail

    @property
    def category(self) -> str:
        # The quota planner explains a refusal in a sentence, not a type of its own.
        return _prose_category(self.detail)


class Reclaim(_Reason, frozen=True, kw_only=True):
    """The cluster took devices back: the round commits the forced shrink."""

    family: ClassVar[Family] = "quota"
    num_devices: int
    """Devices reclaimed."""

    def __str__(self) -> str:
        return f"reclaim of {self.num_devices} devices by the cluster"

    @property
    def category(self) -> str:
        return "reclaim of # devices by the cluster"


# ---------------------------------------------------------------------- candidates


class NotBetterAfterCost(_Reason, frozen=True, kw_only=True):
    """The candidate does not save more than the threshold once its migration is paid."""

    family: ClassVar[Family] = "candidate"
    gain_s: float
    """Predicted iteration time saved net of the migration, seconds."""
    cost_s: float
    """Predicted migration cost, seconds."""
    min_gain_s: float
    """The saving a move must exceed (``SchedulerConfig.min_gain_s``), seconds."""

    def __str__(self) -> str:
        return (
            f"not better after cost: saves {self.gain_s:.3f} s net of {self.cost_s:.3f} s "
            f"migration, needs more than {self.min_gain_s} s"
        )

    @property
    def category(self) -> str:
        return "not better after cost"


class SavesLess(_Reason, frozen=True, kw_only=True):
    """A better candidate was chosen: this one saves less."""

    family: ClassVar[Family] = "candidate"
    gain_s: float
    """Its predicted saving, seconds."""
    chosen_gain_s: float
    """The chosen candidate's, seconds."""

    def __str__(self) -> str:
        return f"saves {self.gain_s:.3f} s, less than the chosen {self.chosen_gain_s:.3f} s"

    @property
    def category(self) -> str:
        return "saves # s, less than the chosen # s"


class FinishesLater(_Reason, frozen=True, kw_only=True):
    """The current allocation cannot finish; the chosen way out finishes earlier."""

    family: ClassVar[Family] = "candidate"
    finish_s: float
    """Its predicted finish (remaining time plus migration cost), seconds."""
    chosen_finish_s: float
    """The chosen candidate's, seconds."""

    def __str__(self) -> str:
        return (
            f"finishes in {self.finish_s:.3f} s, later than the chosen {self.chosen_finish_s:.3f} s"
        )

    @property
    def category(self) -> str:
        return "finishes in # s, later than the chosen # s"


class InfeasiblePlacement(_Reason, frozen=True, kw_only=True):
    """The candidate's sizes cannot be placed (TP groups would span nodes)."""

    family: ClassVar[Family] = "candidate"
    detail: str
    """The placement's error message."""

    def __str__(self) -> str:
        return f"infeasible placement: {self.detail}"

    @property
    def category(self) -> str:
        return "infeasible placement"


class NoMovableDonor(_Reason, frozen=True, kw_only=True):
    """No flagged donor can be planned (none is interruptible with a usable prediction)."""

    family: ClassVar[Family] = "candidate"

    def __str__(self) -> str:
        return "no movable donor"

    @property
    def category(self) -> str:
        return "no movable donor"


class NoFeasibleReduction(_Reason, frozen=True, kw_only=True):
    """No way of shrinking the donors reaches a higher pipeline throughput."""

    family: ClassVar[Family] = "candidate"

    def __str__(self) -> str:
        return "no feasible reduction reaches a higher throughput"

    @property
    def category(self) -> str:
        return "no feasible reduction reaches a higher throughput"


class LegacyReason(_Reason, frozen=True, kw_only=True):
    """A reason from a ledger written before reasons were typed that matches no known form."""

    text: str
    """The reason as it was written."""

    def __str__(self) -> str:
        return self.text

    @property
    def category(self) -> str:
        return _prose_category(self.text)


# ---------------------------------------------------------------------- Stage 2


class Commit(_Reason, frozen=True, kw_only=True):
    """The best candidate saves enough: it is carried out."""

    family: ClassVar[Family] = "commit"
    gain_s: float
    """Predicted iteration time saved net of the migration (infinite: the current
    allocation could not finish), seconds."""
    cost_s: float
    """Predicted migration cost, seconds."""
    bottleneck: str | None
    """The component predicted to limit the pipeline afterwards."""

    def __str__(self) -> str:
        gain = "all remaining work" if math.isinf(self.gain_s) else f"{self.gain_s:.3f} s"
        return (
            f"commit: saves {gain} net of {self.cost_s:.3f} s migration; "
            f"bottleneck {self.bottleneck}"
        )

    @property
    def category(self) -> str:
        return "commit"


CandidateReason = (
    NotBetterAfterCost | SavesLess | FinishesLater | InfeasiblePlacement | LegacyReason
)
"""Why one evaluated candidate was not committed."""
RejectionReason = CandidateReason | NoMovableDonor | NoFeasibleReduction
"""Why a round that reached Stage 2 committed nothing."""


class Rejected(_Reason, frozen=True, kw_only=True):
    """Stage 2 committed nothing: the best candidate's reason, or why there was none."""

    family: ClassVar[Family] = "rejected"
    why: RejectionReason
    """The best candidate's reason, or why no candidate was found."""

    def __str__(self) -> str:
        return f"rejected: {self.why}"

    @property
    def category(self) -> str:
        return f"rejected: {self.why.category}"


class ObserveOnly(_Reason, frozen=True, kw_only=True):
    """Observe-only mode: the round would have committed, and did not."""

    family: ClassVar[Family] = "observe-only"
    would: Commit
    """The commit it would have made."""

    def __str__(self) -> str:
        return f"observe-only, would {self.would}"

    @property
    def category(self) -> str:
        return "observe-only, would commit"


HoldReason = NoDonor | SafeMode | MoveInFlight | MinimumInterval
"""Why a round stopped before Stage 2."""
DecisionReason = (
    HoldReason | QuotaRefused | Reclaim | Commit | Rejected | ObserveOnly | LegacyReason
)
"""Why a decision round committed or did not (a :class:`~dynarl.bus.DecisionRecord`'s
``reason``)."""
