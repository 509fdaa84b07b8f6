"""Token sampling whose randomness is keyed by (seed, sample id, token position).

Each sampled token uses one uniform number computed by a counter-based hash
(SplitMix64's finalizer) of the job seed, the sample id and the token's absolute position
in the sequence. No generator state is carried from step to step, so the draw for a token
does not depend on which engine runs the sequence, what else is in its batch, or whether
the sequence was aborted, retracted or moved and resumed: with the same logits, the same
token comes out. Sampling is inverse-CDF over ``softmax(logits / temperature)``, row by
row; temperature 0 means greedy. Pure functions; run on the engine's compute thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["sample_tokens", "sampling_uniform"]

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sampling_uniform(seed: int, sample_id: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, sample_id, position)."""
    h = _mix64(_mix64(_mix64(seed & _MASK64) ^ (sample_id & _MASK64)) ^ (position & _MASK64))
    return (h >> 11) * 2.0**-53


def sample_tokens(
    logits: torch.Tensor, temperatures: Sequence[float], uniforms: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``(rows, vocab)`` and its log-probability.

    The log-probability is under the distribution sampled from (``logits / temperature``;
    plain logits for greedy rows). Raises ValueError on a negative temperature or a
    length mismatch.
    """
    rows, vocab = logits.shape
    if len(temperatures) != rows or len(uniforms) != rows:
        raise ValueError("sample_tokens needs one temperature and one uniform per row")
    if any(t < 0 for t in temperatures):
        raise ValueError("temperatures must be >= 0")
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=logits.dtype)
    greedy = torch.tensor([t == 0 for t in temperatures])
    logp = torch.log_softmax(logits / temps.unsqueeze(1), dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    target = torch.tensor(uniforms, dtype=logits.dtype) * cdf[:, -1]
    drawn = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn.clamp(max=vocab - 1))
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
