"""The log-prob inference worker: per-token log-probabilities of given sequences.

The inference component of an RL pipeline computes, for sequences the rollout produced,
the log-probability of every token under some weights — the current policy's (the "old"
log-probs of the ratio) or a frozen reference's (the KL term). It runs the trainer's own
model code (:class:`~._gpt.ParallelGPT`, Megatron layers, optionally tensor-parallel),
so its numbers are the ones the trainer would compute for the same weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from dynarl.backends.reference._gpt import GPTConfig, ParallelGPT

__all__ = ["LogProbWorker"]

logger = logging.getLogger(__name__)


class LogProbWorker:
    """Scores sequences under loaded weights; one per inference device (or TP group).

    :meth:`compute` is collective over ``tp_group``: every TP rank calls it with the same
    sequences. Raises ValueError at construction on a bad micro-batch size.
    """

    def __init__(
        self,
        model: GPTConfig,
        *,
        tp_group: dist.ProcessGroup,
        micro_batch_size: int = 32,
        temperature: float = 1.0,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model = ParallelGPT(model, tp_group=tp_group)
        self.model.eval()
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.weight_version = -1
        self.num_scored_tokens = 0

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Install a full state dict as weight version ``version``.

        Raises ValueError on a state dict of another architecture.
        """
        self.model.load_full_state_dict(dict(state))
        self.weight_version = version
        logger.info("log-prob worker weights -> version %d", version)

    @torch.no_grad()
    def compute(self, sequences: Sequence[Sequence[int]]) -> list[tuple[float, ...]]:
        """For each sequence, ``len(seq) − 1`` log-probs: entry t is that of token t + 1.

        Raises ValueError before weights are loaded, or on a sequence shorter than two
        tokens or longer than the model's ``max_seq_len``.
        """
        if self.weight_version < 0:
            raise ValueError("LogProbWorker.compute before load_weights")
        if any(len(seq) < 2 for seq in sequences):
            raise ValueError("every sequence needs at least two tokens")
        out: list[tuple[float, ...]] = []
        for start in range(0, len(sequences), self.micro_batch_size):
            out.extend(self._micro(sequences[start : start + self.micro_batch_size]))
        return out

    def _micro(self, batch: Sequence[Sequence[int]]) -> list[tuple[float, ...]]:
        length = max(len(seq) for seq in batch)
        tokens = torch.zeros(len(batch), length, dtype=torch.long)
        for i, seq in enumerate(batch):
            tokens[i, : len(seq)] = torch.tensor(list(seq))
        logp = self.model.token_logprobs(tokens, temperature=self.temperature)
        self.num_scored_tokens += sum(len(seq) - 1 for seq in batch)
        return [tuple(logp[i, : len(seq) - 1].tolist()) for i, seq in enumerate(batch)]
