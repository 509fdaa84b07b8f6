"""Ledgers written when decision reasons were sentences: each sentence back into its struct.

Before reasons were typed (:mod:`dynarl.bus._decision_reasons`), a
:class:`~dynarl.bus.DecisionRecord`'s ``reason``, its rejected candidates' ``reason`` and a
:class:`~dynarl.sched._ledger_records.RoundsRecord`'s ``reasons`` were the sentences the
scheduler composed. :func:`upgrade_line` takes one decoded JSON line of such a ledger and
puts the struct in place of each sentence, so the line decodes as a record of today.
Every sentence the scheduler wrote has one form here, with its numbers as written
(seconds to the millisecond), so ``str(struct)`` gives the sentence back; a sentence that
fits no form becomes a :class:`~dynarl.bus.LegacyReason` holding it verbatim. The only
place a reason is read from text, and only for files written before. Pure; runs anywhere.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import msgspec

from dynarl.bus import (
    CandidateReason,
    Commit,
    DecisionReason,
    FinishesLater,
    InfeasiblePlacement,
    LegacyReason,
    MinimumInterval,
    MoveInFlight,
    NoDonor,
    NoFeasibleReduction,
    NoMovableDonor,
    NotBetterAfterCost,
    ObserveOnly,
    QuotaRefused,
    Reclaim,
    Rejected,
    RejectionReason,
    SafeMode,
    SavesLess,
)

__all__ = ["candidate_reason", "decision_reason", "upgrade_line"]

_NUM = r"([-+]?(?:\d+(?:\.\d*)?|inf|nan))"
"""A number as ``f"{x:.3f}"`` writes it."""


def _forms(
    *forms: tuple[str, Callable[..., Any]],
) -> list[tuple[re.Pattern[str], Callable[..., Any]]]:
    return [(re.compile(pattern, re.DOTALL), build) for pattern, build in forms]


_CANDIDATE = _forms(
    (
        rf"not better after cost: saves {_NUM} s net of {_NUM} s migration, "
        r"needs more than (\S+) s",
        lambda gain, cost, least: NotBetterAfterCost(
            gain_s=float(gain), cost_s=float(cost), min_gain_s=float(least)
        ),
    ),
    (
        rf"saves {_NUM} s, less than the chosen {_NUM} s",
        lambda gain, chosen: SavesLess(gain_s=float(gain), chosen_gain_s=float(chosen)),
    ),
    (
        rf"finishes in {_NUM} s, later than the chosen {_NUM} s",
        lambda finish, chosen: FinishesLater(finish_s=float(finish), chosen_finish_s=float(chosen)),
    ),
    (r"infeasible placement: (.*)", lambda detail: InfeasiblePlacement(detail=detail)),
)
_NOTE = _forms(
    (r"no movable donor", NoMovableDonor),
    (r"no feasible reduction reaches a higher throughput", NoFeasibleReduction),
)
_COMMIT = _forms(
    (
        rf"commit: saves (?:all remaining work|{_NUM} s) net of {_NUM} s migration; "
        r"bottleneck (.*)",
        lambda gain, cost, bottleneck: Commit(
            gain_s=math.inf if gain is None else float(gain),
            cost_s=float(cost),
            bottleneck=None if bottleneck == "None" else bottleneck,
        ),
    ),
)
_DECISION = _forms(
    (r"hold: no donor", NoDonor),
    (r"hold: safe mode: (.*)", lambda why: SafeMode(why=why)),
    (r"hold: move (\S+) still in flight", lambda decision: MoveInFlight(decision_id=decision)),
    (
        rf"hold: minimum interval between moves: {_NUM} s to go",
        lambda wait: MinimumInterval(wait_s=float(wait)),
    ),
    (r"reclaim of (\d+) devices by the cluster", lambda n: Reclaim(num_devices=int(n))),
    (
        r"(quota change to \d+ devices refused: .*|reclaim refused: .*)",
        lambda detail: QuotaRefused(detail=detail),
    ),
)


def _match(text: str, *forms: list[tuple[re.Pattern[str], Callable[..., Any]]]) -> Any:
    """The struct of the first form ``text`` fits entirely, or None."""
    for pattern, build in (form for group in forms for form in group):
        found = pattern.fullmatch(text)
        if found is not None:
            return build(*found.groups())
    return None


def candidate_reason(text: str) -> CandidateReason:
    """The struct of a rejected candidate's sentence (:class:`LegacyReason` if none fits)."""
    reason: CandidateReason | None = _match(text, _CANDIDATE)
    return reason if reason is not None else LegacyReason(text=text)


def decision_reason(text: str) -> DecisionReason:
    """The struct of a decision round's sentence (:class:`LegacyReason` if none fits)."""
    reason: DecisionReason | None = _match(text, _DECISION, _COMMIT)
    if reason is None and text.startswith("rejected: "):
        why: RejectionReason | None = _match(text.removeprefix("rejected: "), _CANDIDATE, _NOTE)
        reason = Rejected(why=why) if why is not None else None
    if reason is None and text.startswith("observe-only, would "):
        would: Commit | None = _match(text.removeprefix("observe-only, would "), _COMMIT)
        reason = ObserveOnly(would=would) if would is not None else None
    return reason if reason is not None else LegacyReason(text=text)


def upgrade_line(line: Any) -> Any:
    """``line`` (one ledger line, decoded to builtins) with each sentence reason replaced
    by its struct's builtins; any other line as it is."""
    if not isinstance(line, dict):
        return line
    match line.get("type"):
        case "DecisionRecord":
            return _upgrade_decision(line)
        case "RoundsRecord":
            upgraded = dict(line)
            if isinstance(line.get("first"), dict):
                upgraded["first"] = _upgrade_decision(line["first"])
            if isinstance(line.get("reasons"), list):
                upgraded["reasons"] = [_decision(r) for r in line["reasons"]]
            return upgraded
        case _:
            return line


def _upgrade_decision(record: dict[str, Any]) -> dict[str, Any]:
    upgraded = dict(record)
    if "reason" in record:
        upgraded["reason"] = _decision(record["reason"])
    if isinstance(record.get("rejected"), list):
        upgraded["rejected"] = [
            {**c, "reason": _builtins(candidate_reason(c["reason"]))}
            if isinstance(c, dict) and isinstance(c.get("reason"), str)
            else c
            for c in record["rejected"]
        ]
    return upgraded


def _decision(reason: Any) -> Any:
    return _builtins(decision_reason(reason)) if isinstance(reason, str) else reason


def _builtins(reason: DecisionReason | CandidateReason) -> Any:
    return msgspec.to_builtins(reason)
