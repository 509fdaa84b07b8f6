"""Bus samples as the Megatron trainer role trains on them: micro-batches and TrainSamples.

The role reads the metadata keys a GRPO job puts on its samples (the reference job's
names, so one driver can feed either trainer): ``group``, the sample's micro-batch (its
prompt group) in the step; ``advantage``, its GRPO advantage; ``env``, the response spans
the environment wrote (``"start:end,..."``, masked out of training); ``seed_id``, the
order of the samples inside a micro-batch (their ids otherwise). Pure; runs anywhere.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from dynarl.backends._grpo import TrainSample
from dynarl.backends._sample_keys import ADVANTAGE, ENV_SPANS, GROUP, SEED_ID, policy_mask
from dynarl.bus import Sample, unpack_floats, unpack_tokens

__all__ = ["ADVANTAGE", "ENV_SPANS", "GROUP", "SEED_ID", "micro_batches", "train_sample"]


def micro_batches(samples: Sequence[Sample]) -> dict[int, list[Sample]]:
    """``samples`` by micro-batch index, each micro-batch in a fixed order (whatever the
    order they arrived in). Raises ValueError for a sample without an integer ``group``."""
    groups: dict[int, list[Sample]] = defaultdict(list)
    for sample in samples:
        group = sample.metadata.get(GROUP)
        if not isinstance(group, int) or isinstance(group, bool) or group < 0:
            raise ValueError(f"sample {sample.sample_id} has no micro-batch ({GROUP!r})")
        groups[group].append(sample)
    return {index: sorted(group, key=_order) for index, group in sorted(groups.items())}


def train_sample(sample: Sample, *, old: str = "current") -> TrainSample:
    """``sample`` as a :class:`TrainSample`: per-target arrays over all its tokens, prompt
    and environment tokens masked out, the advantage from the metadata. ``old``:
    ``current`` (ratios against the current policy: 1) or ``rollout`` (against the
    log-probs the sample was generated with, one per response token). Raises ValueError for
    a sample without a prompt or a response, or an unknown ``old``."""
    if old not in ("current", "rollout"):
        raise ValueError(f"old must be 'current' or 'rollout', got {old!r}")
    tokens = tuple(int(t) for t in unpack_tokens(sample.token_ids))
    if sample.prompt_len < 1 or len(tokens) <= sample.prompt_len:
        raise ValueError(f"sample {sample.sample_id} needs a prompt and response tokens")
    policy = tuple(policy_mask(sample))
    advantage = sample.metadata.get(ADVANTAGE, 0.0)
    olds = None
    if old == "rollout":
        generated = iter(float(x) for x in unpack_floats(sample.logprobs))
        olds = (0.0,) * (sample.prompt_len - 1) + tuple(
            next(generated, 0.0) if mine else 0.0 for mine in policy
        )
    return TrainSample(
        tokens=tokens,
        loss_mask=(False,) * (sample.prompt_len - 1) + policy,
        advantage=float(advantage) if isinstance(advantage, int | float) else 0.0,
        old_logprobs=olds,
    )


def _order(sample: Sample) -> tuple[int, str]:
    seed = sample.metadata.get(SEED_ID)
    return (int(seed), "") if isinstance(seed, int) else (0, sample.sample_id)
