"""What the fake samples, and the weight-version spans SGLang 0.5.23 reports for it.

:func:`next_token` is the fake's deterministic "model": a token and its log-probability as
a function of the sequence so far, so a request continued elsewhere from its partial output
produces the same tokens and log-probabilities as an uninterrupted one.

:func:`version_spans` is SGLang's arithmetic for ``meta_info.weight_versions``
(``srt/utils/weight_versions.py``): a version change records, for each live request with
output, the old version and how many tokens it had reached (``record_weight_version_events``);
the final reply turns those events and the current version into contiguous spans
(``compute_weight_version_spans``) clipped to the output (``add_weight_versions_to_meta_info``).
An empty output gets one empty span ``{"start": 0, "end": 0}``, as SGLang's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["VersionEvent", "next_token", "token_logprob", "version_spans"]


@dataclass(frozen=True, slots=True)
class VersionEvent:
    """The weight version changed from ``old_version`` when a request had produced
    ``num_output_tokens`` tokens (SGLang's ``WeightVersionEvent``)."""

    old_version: str
    num_output_tokens: int


def next_token(sequence: Sequence[int]) -> tuple[int, float]:
    """The token after ``sequence`` (a lowercase letter, from its last three tokens and its
    length) and its log-probability (in [-4, -1/1024], from the same inputs)."""
    mixed = _mixed(sequence)
    return 97 + mixed % 26, -(1 + (mixed * 7919) % 4096) / 1024


def token_logprob(sequence: Sequence[int], token: int) -> float:
    """The fake model's log-probability of ``token`` after ``sequence`` (what scoring a
    prompt reports): :func:`next_token`'s own for the token it would sample, and a value
    in [-8, -4) from the same inputs for any other."""
    sampled, logprob = next_token(sequence)
    if token == sampled:
        return logprob
    return -4 - ((_mixed(sequence) + token) * 104729 % 4096) / 1024


def _mixed(sequence: Sequence[int]) -> int:
    tail = sequence[-3:]
    mixed = sum((token + 1) * weight for token, weight in zip(tail, (7, 31, 17), strict=False))
    return mixed + 13 * len(sequence)


def version_spans(
    events: Sequence[VersionEvent], current: str, num_output_tokens: int
) -> list[dict[str, Any]]:
    """``meta_info.weight_versions`` of a request's final reply."""
    spans: list[dict[str, Any]] = []
    changes = [(event.old_version, event.num_output_tokens) for event in events]
    for version, reached in [*changes, (current, num_output_tokens)]:
        end = min(reached, num_output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": version, "start": start, "end": end})
    return [span for span in spans if span["start"] < num_output_tokens or span["start"] == 0]
