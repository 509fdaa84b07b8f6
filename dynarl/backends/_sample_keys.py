"""What a GRPO job writes on its bus samples for the trainer, whichever trainer it is (the
reference one, the Megatron role): the metadata keys and the environment's token spans.

The keys: ``seed_id`` (the episode's integer id: it keys sampling and orders a
micro-batch), ``group`` (the sample's prompt group in its step: its micro-batch),
``advantage`` (set once the group is scored) and ``env`` (the response token spans the
environment wrote, ``"start:end,..."``: tool results, masked out of training). Pure; runs
anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynarl.bus import MetaValue, Sample, unpack_tokens

__all__ = [
    "ADVANTAGE",
    "ENV_SPANS",
    "GROUP",
    "SEED_ID",
    "decode_spans",
    "encode_spans",
    "policy_mask",
]

SEED_ID = "seed_id"
"""Integer id of the episode; keys sampling with the job seed and the token position, and
orders the samples of a micro-batch."""
GROUP = "group"
"""Index of the sample's prompt in its step: its micro-batch."""
ADVANTAGE = "advantage"
"""GRPO advantage of the sample (set once its group is complete)."""
ENV_SPANS = "env"
"""Response token spans the environment wrote (``"start:end,..."``), not the policy."""


def encode_spans(spans: Sequence[tuple[int, int]]) -> str:
    """``[(3, 7)]`` as ``"3:7"``."""
    return ",".join(f"{a}:{b}" for a, b in spans)


def decode_spans(text: MetaValue) -> list[tuple[int, int]]:
    """The spans of :func:`encode_spans` text (none for anything else)."""
    if not isinstance(text, str) or not text:
        return []
    out = []
    for part in text.split(","):
        a, _, b = part.partition(":")
        out.append((int(a), int(b)))
    return out


def policy_mask(sample: Sample) -> list[bool]:
    """Per response token: True where the policy generated it (not in an ``env`` span)."""
    length = len(unpack_tokens(sample.token_ids)) - sample.prompt_len
    mask = [True] * length
    for start, end in decode_spans(sample.metadata.get(ENV_SPANS)):
        for i in range(max(start, 0), min(end, length)):
            mask[i] = False
    return mask
