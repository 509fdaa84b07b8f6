"""Reference samples on the bus: metadata keys, and conversions to engine and trainer form.

A generation travels as the bus's ``GenerationRequest`` / ``Sample`` (token ids packed,
log-probabilities packed float32, scalar metadata). The keys a GRPO job adds for
its trainer (episode id, prompt group, advantage, environment spans) are shared with the
Megatron trainer (:mod:`dynarl.backends._sample_keys`, re-exported here); the reference job
adds the step and the tool calls done.
Pure; runs anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynarl.backends._grpo import TrainSample
from dynarl.backends._sample_keys import (
    ADVANTAGE,
    ENV_SPANS,
    GROUP,
    SEED_ID,
    decode_spans,
    encode_spans,
    policy_mask,
)
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

STEP = "step"
"""The training step the sample belongs to."""
TOOL_CALLS = "tool_calls"
"""Tool calls the episode has completed (a request priority key)."""


def meta_float(value: MetaValue) -> float:
    """A numeric metadata or call-result value as a float; NaN when it is absent or not a
    number."""
    return float(value) if isinstance(value, int | float) else float("nan")


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
