"""Reference samples on the bus: metadata keys, and conversions to engine and trainer form.

A generation travels as the bus's ``GenerationRequest`` / ``Sample`` (token ids packed,
log-probabilities packed float32, scalar metadata). The keys below say what a reference
job adds: the integer id that keys sampling (one per episode, whatever the turn), the
prompt group (= the micro-batch of the step), the advantage once the group is scored,
and the spans of tokens the environment wrote (tool results, masked out of training).
Pure; runs anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynarl.backends._grpo import TrainSample
from dynarl.bus import MetaValue, Sample, pack_floats, unpack_floats, unpack_tokens

__all__ = [
    "ADVANTAGE",
    "ENV_SPANS",
    "GROUP",
    "SEED_ID",
    "STEP",
    "TOOL_CALLS",
    "decode_spans",
    "encode_spans",
    "meta_float",
    "pack_floats",
    "policy_mask",
    "to_train_sample",
    "unpack_floats",
]

SEED_ID = "seed_id"
"""Integer id of the episode; keys sampling with the job seed and the token position."""
GROUP = "group"
"""Index of the sample's prompt in its step: its micro-batch."""
STEP = "step"
"""The training step the sample belongs to."""
ADVANTAGE = "advantage"
"""GRPO advantage of the sample (set once its group is complete)."""
ENV_SPANS = "env"
"""Response token spans the environment wrote (``"start:end,..."``), not the policy."""
TOOL_CALLS = "tool_calls"
"""Tool calls the episode has completed (a request priority key)."""


def meta_float(value: MetaValue) -> float:
    """A numeric metadata or call-result value as a float; NaN when it is absent or not a
    number."""
    return float(value) if isinstance(value, int | float) else float("nan")


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
    """Per response token: True where the policy generated it."""
    length = len(unpack_tokens(sample.token_ids)) - sample.prompt_len
    mask = [True] * length
    for start, end in decode_spans(sample.metadata.get(ENV_SPANS)):
        for i in range(max(start, 0), min(end, length)):
            mask[i] = False
    return mask


def to_train_sample(
    sample: Sample,
    *,
    old_logprobs: Sequence[float] | None = None,
    ref_logprobs: Sequence[float] | None = None,
) -> TrainSample:
    """``sample`` as a :class:`TrainSample`: per-target arrays over all its tokens, the
    prompt masked out, its advantage from the metadata (0 without one). Raises
    ValueError for a sample without a response."""
    tokens = tuple(int(t) for t in unpack_tokens(sample.token_ids))
    if len(tokens) <= sample.prompt_len:
        raise ValueError(f"sample {sample.sample_id} has no response tokens")
    mask = (False,) * (sample.prompt_len - 1) + tuple(policy_mask(sample))
    advantage = sample.metadata.get(ADVANTAGE, 0.0)
    return TrainSample(
        tokens=tokens,
        loss_mask=mask,
        advantage=float(advantage) if isinstance(advantage, int | float) else 0.0,
        old_logprobs=None if old_logprobs is None else tuple(old_logprobs),
        ref_logprobs=None if ref_logprobs is None else tuple(ref_logprobs),
    )
