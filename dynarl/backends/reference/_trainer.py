"""The reference trainer: ParallelGPT under tensor and data parallelism, torch.optim.Adam.

Every rank of the trainer calls :meth:`Trainer.train_step` with the same *global* batch.
The batch is cut into a fixed sequence of micro-batches of ``micro_batch_size`` samples
(the cut depends on the batch only); micro-batch j runs on data-parallel rank
``j mod dp``. Losses are divided by the number of policy tokens in the global batch, so
the gradient of the batch is the plain sum of the micro-batch gradients.

* **Deterministic mode**: each micro-batch's gradient is computed on its own (same
  weights, same inputs, same shapes wherever it runs), the per-micro-batch gradients are
  all-gathered over the data-parallel group and summed in micro-batch order on every
  rank. The sum is therefore the same float sequence for any DP size: a given global
  batch gives bitwise-identical parameters with DP = 1, 2, 3, ... (tests/dist proves
  it). It assumes the same intra-op thread count everywhere and costs an all-gather of
  one gradient per micro-batch.
* **Fast mode**: gradients accumulate locally, then one flat all-reduce (parameters in a
  fixed order) sums them; deterministic run to run for a fixed DP size only.

Tensor parallelism uses Megatron's layers (reductions of partial products over the TP
group), so TP = 2 matches TP = 1 to float tolerance, not bitwise. The optimizer is
``torch.optim.Adam`` on the local shards (the Megatron optimizer needs CUDA).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dynarl.backends._grpo import (
    GRPOConfig,
    StepStats,
    TrainSample,
    pad_samples,
    per_target,
    policy_loss,
)
from dynarl.backends.reference._gpt import GPTConfig, ParallelGPT, param_layout

__all__ = [
    "TrainConfig",
    "Trainer",
    "TrainerState",
    "state_checksum",
]

logger = logging.getLogger(__name__)

_NUM_SCALARS = 3  # loss, kl, clipped tokens ride along with each micro-batch gradient


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Optimizer, batching and loss settings of a :class:`Trainer`."""

    lr: float = 1e-3
    """Adam learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Adam (L2) weight decay."""
    max_grad_norm: float | None = 1.0
    """Clip the full gradient to this L2 norm (None: no clipping)."""
    micro_batch_size: int = 8
    """Samples per micro-batch; fixes the decomposition of every global batch."""
    deterministic: bool = True
    """DP-size-invariant gradient sums (see the module docstring)."""
    temperature: float = 1.0
    """Log-probs are taken under ``logits / temperature`` (match the rollout's)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Loss settings."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.adam_eps <= 0 or self.weight_decay < 0:
            raise ValueError("TrainConfig needs lr > 0, adam_eps > 0, weight_decay >= 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"TrainConfig.betas must be in [0, 1), got {self.betas}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.temperature <= 0:
            raise ValueError(f"TrainConfig.temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerState:
    """Everything a trainer's future depends on, unsharded (for reshards and checks)."""

    params: dict[str, torch.Tensor]
    """Full parameters by name."""
    exp_avg: dict[str, torch.Tensor]
    """Adam first moments, full, by parameter name."""
    exp_avg_sq: dict[str, torch.Tensor]
    """Adam second moments, full, by parameter name."""
    adam_step: int
    """Adam's step count."""
    version: int
    """Weight version (optimizer steps taken, including supervised ones)."""


_LossFn = Callable[[ParallelGPT, Sequence[TrainSample], float], tuple[torch.Tensor, torch.Tensor]]


def state_checksum(state: TrainerState) -> str:
    """SHA-256 over every tensor of ``state`` (in layout order), the step and version."""
    digest = hashlib.sha256(f"{state.adam_step}:{state.version}".encode())
    for part in (state.params, state.exp_avg, state.exp_avg_sq):
        for name, tensor in part.items():
            digest.update(name.encode())
            digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


class Trainer:
    """One rank of a TP × DP trainer; collective methods are called by every rank alike.

    ``tp_group`` and ``dp_group`` are passed explicitly (a reshard builds a new trainer
    over new groups and loads the old one's :class:`TrainerState`). Raises ValueError if
    the model does not split over ``tp_group``.
    """

    def __init__(
        self,
        model: GPTConfig,
        config: TrainConfig,
        *,
        tp_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup,
    ) -> None:
        self.config = config
        self.model = ParallelGPT(model, tp_group=tp_group)
        self.dp_group = dp_group
        layout = param_layout(model)
        self._names = [shard.name for shard in layout]
        self._sharded = [shard.partition_dim is not None for shard in layout]
        self._params = [param for _, param in self.model.named_parameters()]
        self._numel = sum(param.numel() for param in self._params)
        self.optimizer = torch.optim.Adam(
            self._params,
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            foreach=False,
        )
        self.version = 0

    @property
    def dp_rank(self) -> int:
        """This rank's index in the data-parallel group."""
        return int(self.dp_group.rank())

    @property
    def dp_size(self) -> int:
        """Data-parallel size."""
        return int(self.dp_group.size())

    def set_lr(self, lr: float) -> None:
        """Use learning rate ``lr`` from the next step on; raises ValueError if not > 0."""
        if lr <= 0:
            raise ValueError(f"learning rate must be > 0, got {lr}")
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ------------------------------------------------------------------ steps
    def train_step(self, samples: Sequence[TrainSample]) -> StepStats:
        """One GRPO optimizer step on the global batch ``samples`` (collective).

        Raises ValueError on an empty batch, or if the KL term is on and a sample lacks
        reference log-probs.
        """
        if self.config.grpo.kl_coef > 0 and any(s.ref_logprobs is None for s in samples):
            raise ValueError("kl_coef > 0 needs ref_logprobs on every sample")
        return self._step(samples, self._grpo_loss)

    def sft_step(self, samples: Sequence[TrainSample]) -> StepStats:
        """One supervised (cross-entropy on ``loss_mask`` tokens) step (collective).

        Raises ValueError on an empty batch.
        """
        return self._step(samples, _sft_loss)

    def _step(self, samples: Sequence[TrainSample], loss_fn: _LossFn) -> StepStats:
        if not samples:
            raise ValueError("empty training batch")
        num_tokens = sum(sum(sample.loss_mask) for sample in samples)
        normalizer = float(max(1, num_tokens))
        size = self.config.micro_batch_size
        micros = [samples[i : i + size] for i in range(0, len(samples), size)]
        mine = micros[self.dp_rank :: self.dp_size]
        if self.config.deterministic:
            total = self._ordered_sum(self._micro_rows(mine, loss_fn, normalizer), len(micros))
        else:
            total = self._all_reduced(mine, loss_fn, normalizer)
        grad_norm, (loss, kl, clipped) = self._optimizer_step(total)
        return StepStats(
            version=self.version,
            loss=loss,
            kl=kl,
            clip_fraction=clipped / normalizer,
            num_tokens=num_tokens,
            num_samples=len(samples),
            grad_norm=grad_norm,
        )

    def _optimizer_step(self, total: torch.Tensor) -> tuple[float, list[float]]:
        """Install ``total``'s flat gradient, clip it, step; (grad norm, its scalars)."""
        self._set_grads(total[: self._numel])
        grad_norm = self._grad_norm()
        if self.config.max_grad_norm is not None and grad_norm > self.config.max_grad_norm:
            scale = self.config.max_grad_norm / (grad_norm + 1e-6)
            for param in self._params:
                assert param.grad is not None
                param.grad.mul_(scale)
        self.optimizer.step()
        self.version += 1
        scalars: list[float] = total[self._numel :].tolist()
        return grad_norm, scalars

    # ------------------------------------------------------------------ streamed steps
    def micro_gradient(self, micro: Sequence[TrainSample], *, num_samples: int) -> torch.Tensor:
        """The gradient row of one micro-batch of a streamed GRPO step (local, no collective).

        The row is the flat gradient followed by (loss, kl, clip fraction), all under the
        sequence-mean normalisation of GRPO: each sample's token losses are averaged over
        its policy tokens and the step's loss is their sum over the ``num_samples``
        samples of the whole step, divided by ``num_samples``. That normaliser is known
        before any sample is generated, so a micro-batch's row can be computed as soon as
        the micro-batch is complete, on any rank, in any order; the step is the sum of the
        rows in micro-batch order (:meth:`apply_gradient`). The weights must not change
        between the rows of one step. Raises ValueError on an empty micro-batch, a
        non-positive ``num_samples``, or missing reference log-probs with ``kl_coef > 0``.
        """
        if not micro or num_samples < 1:
            raise ValueError("micro_gradient needs samples and num_samples >= 1")
        if self.config.grpo.kl_coef > 0 and any(s.ref_logprobs is None for s in micro):
            raise ValueError("kl_coef > 0 needs ref_logprobs on every sample")
        self.optimizer.zero_grad(set_to_none=True)
        scalars = self._backward(micro, self._sequence_mean_loss, float(num_samples))
        row = torch.cat([self._flat_grads(), scalars])
        self.optimizer.zero_grad(set_to_none=True)
        return row

    def apply_gradient(
        self, total: torch.Tensor, *, num_samples: int, num_tokens: int
    ) -> StepStats:
        """One optimizer step with ``total``, the sum of a step's micro-batch rows (every
        rank passes the same sum); clips as :meth:`train_step` does. Raises ValueError on
        a row of the wrong size."""
        if total.shape != (self._numel + _NUM_SCALARS,):
            raise ValueError(f"gradient row has shape {tuple(total.shape)}, expected one flat row")
        grad_norm, (loss, kl, clipped) = self._optimizer_step(total)
        return StepStats(
            version=self.version,
            loss=loss,
            kl=kl,
            clip_fraction=clipped,
            num_tokens=num_tokens,
            num_samples=num_samples,
            grad_norm=grad_norm,
        )

    @property
    def row_size(self) -> int:
        """Length of a gradient row (parameters plus the three scalars)."""
        return self._numel + _NUM_SCALARS

    def _sequence_mean_loss(
        self, model: ParallelGPT, micro: Sequence[TrainSample], num_samples: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask = pad_samples(micro)
        per_sample = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        weights = mask / (per_sample * num_samples)
        logp = model.token_logprobs(tokens, temperature=self.config.temperature)
        old = per_target(micro, "old_logprobs", logp.detach())
        ref = per_target(micro, "ref_logprobs", logp.detach())
        advantages = torch.tensor([sample.advantage for sample in micro], dtype=torch.float32)
        out = policy_loss(
            logp,
            old,
            advantages,
            weights,
            config=self.config.grpo,
            normalizer=1.0,
            ref_logprobs=ref,
        )
        return out.loss, torch.stack([out.loss.detach(), out.kl, out.clipped])

    def _backward(
        self, micro: Sequence[TrainSample], loss_fn: _LossFn, normalizer: float
    ) -> torch.Tensor:
        loss, scalars = loss_fn(self.model, micro, normalizer)
        torch.autograd.backward(loss)
        return scalars

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat(
            [torch.zeros(p.numel()) if p.grad is None else p.grad.reshape(-1) for p in self._params]
        )

    def _micro_rows(
        self, micros: Sequence[Sequence[TrainSample]], loss_fn: _LossFn, normalizer: float
    ) -> list[torch.Tensor]:
        rows = []
        for micro in micros:
            self.optimizer.zero_grad(set_to_none=True)
            scalars = self._backward(micro, loss_fn, normalizer)
            rows.append(torch.cat([self._flat_grads(), scalars]))
        return rows

    def _ordered_sum(self, rows: list[torch.Tensor], num_micros: int) -> torch.Tensor:
        """Sum every micro-batch's row in micro-batch order, whatever rank computed it."""
        dp = self.dp_size
        if dp == 1:
            ordered = rows
        else:
            per_rank = -(-num_micros // dp)
            buffer = torch.zeros(per_rank, self._numel + _NUM_SCALARS)
            for i, row in enumerate(rows):
                buffer[i] = row
            gathered = [torch.empty_like(buffer) for _ in range(dp)]
            dist.all_gather(gathered, buffer, group=self.dp_group)
            ordered = [gathered[j % dp][j // dp] for j in range(num_micros)]
        total = ordered[0].clone()
        for row in ordered[1:]:
            total += row
        return total

    def _all_reduced(
        self, micros: Sequence[Sequence[TrainSample]], loss_fn: _LossFn, normalizer: float
    ) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        scalars = torch.zeros(_NUM_SCALARS)
        for micro in micros:
            scalars += self._backward(micro, loss_fn, normalizer)
        total = torch.cat([self._flat_grads(), scalars])
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.dp_group)
        return total

    def _set_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for param in self._params:
            n = param.numel()
            param.grad = flat[offset : offset + n].view_as(param).clone()
            offset += n

    def _grad_norm(self) -> float:
        first_tp_rank = self.model.tp_rank == 0
        squares = torch.zeros((), dtype=torch.float64)
        for param, sharded in zip(self._params, self._sharded, strict=True):
            if (sharded or first_tp_rank) and param.grad is not None:
                squares += param.grad.double().square().sum()
        if self.model.tp_size > 1:
            dist.all_reduce(squares, group=self.model.tp_group)
        return float(squares.sqrt())

    def _grpo_loss(
        self, model: ParallelGPT, micro: Sequence[TrainSample], normalizer: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask = pad_samples(micro)
        logp = model.token_logprobs(tokens, temperature=self.config.temperature)
        old = per_target(micro, "old_logprobs", logp.detach())
        ref = per_target(micro, "ref_logprobs", logp.detach())
        advantages = torch.tensor([sample.advantage for sample in micro], dtype=torch.float32)
        out = policy_loss(
            logp, old, advantages, mask,
            config=self.config.grpo, normalizer=normalizer, ref_logprobs=ref,
        )  # fmt: skip
        return out.loss, torch.stack([out.loss.detach(), out.kl, out.clipped])

    # ------------------------------------------------------------------ state
    def full_state(self) -> TrainerState:
        """Unsharded parameters and optimizer state (collective over the TP group)."""
        params = self.model.full_state_dict()
        moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
        step = 0
        for name, param in zip(self._names, self._params, strict=True):
            state = self.optimizer.state.get(param, {})
            if "step" in state:
                step = int(state["step"])
            for key, part in moments.items():
                shard = state.get(key, torch.zeros_like(param))
                part[name] = self.model.gather_full(name, shard.detach())
        return TrainerState(
            params=params,
            exp_avg=moments["exp_avg"],
            exp_avg_sq=moments["exp_avg_sq"],
            adam_step=step,
            version=self.version,
        )

    @torch.no_grad()
    def load_full_state(self, state: TrainerState) -> None:
        """Take this rank's shards of ``state`` (parameters, moments, step, version).

        Raises ValueError on a state of another architecture.
        """
        self.model.load_full_state_dict(state.params)
        for name, param in zip(self._names, self._params, strict=True):
            self.optimizer.state[param] = {
                "step": torch.tensor(float(state.adam_step)),
                "exp_avg": self.model.shard_of(name, state.exp_avg[name]).clone(),
                "exp_avg_sq": self.model.shard_of(name, state.exp_avg_sq[name]).clone(),
            }
        self.version = state.version

    def state_checksum(self) -> str:
        """:func:`state_checksum` of :meth:`full_state` (collective over the TP group)."""
        return state_checksum(self.full_state())


def _sft_loss(
    model: ParallelGPT, micro: Sequence[TrainSample], normalizer: float
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, mask = pad_samples(micro)
    loss = -(model.token_logprobs(tokens) * mask).sum() / normalizer
    zero = torch.zeros(())
    return loss, torch.stack([loss.detach(), zero, zero])
