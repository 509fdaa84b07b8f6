"""The gradient rows of a streamed step, kept per rank and summed in micro-batch order.

A streamed GRPO step is the sum of the gradient rows of its micro-batches
(:meth:`~dynarl.backends.megatron.MegatronTrainer.micro_gradient`); each data-parallel rank
keeps the rows it computed — in whatever order the micro-batches completed, while the
trainer held one device or several — in a :class:`GradientRows`. :meth:`GradientRows.total`
makes the step's sum on every rank of the data-parallel group: the rows are exchanged (one
all-reduce of a ``(num_micros, row)`` matrix in which exactly one rank contributes each
row, so the exchange adds only zeros) and summed from zero in micro-batch order
``0, 1, ..., M-1``. The result is the same float sequence whatever the data-parallel size,
whichever rank computed which row and in which order they arrived.

A row is laid out by :func:`gradient_row`: Megatron DDP's gradient buffers (dense, then
expert-parallel), flat, in order, then :data:`ROW_SCALARS` token sums; :func:`write_gradient`
puts a summed row back into the buffers.

Runs on the trainer's compute thread; ``total`` is collective over the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dynarl.errors import BackendError

__all__ = [
    "ROW_SCALARS",
    "GradientRows",
    "grad_buffers",
    "gradient_row",
    "row_length",
    "write_gradient",
]

ROW_SCALARS = 4
"""Scalars at the end of a gradient row: loss, KL, clipped tokens, policy tokens."""


def grad_buffers(ddp: Any) -> list[Any]:
    """Megatron DDP's gradient buffers (dense, then expert-parallel), in order (its
    ``buffers`` attribute hides ``nn.Module.buffers``)."""
    return [*ddp.buffers, *ddp.expert_parallel_buffers]


def row_length(ddp: Any) -> int:
    """Length of the gradient rows of ``ddp``'s model on this rank."""
    return sum(int(b.grad_data.numel()) for b in grad_buffers(ddp)) + ROW_SCALARS


def gradient_row(ddp: Any, scalars: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """This rank's row: the flat gradient buffers (float32), the micro-batch's ``scalars``
    (loss, KL, clipped tokens) and its policy-token ``count``."""
    grads = [b.grad_data.detach().reshape(-1).float() for b in grad_buffers(ddp)]
    return torch.cat([*grads, scalars.detach().float(), count])


def write_gradient(ddp: Any, total: torch.Tensor) -> tuple[float, float, float, float]:
    """Write ``total`` (a summed row) divided by its policy tokens (at least one) into
    ``ddp``'s gradient buffers; return its token sums (loss, KL, clipped, policy tokens).
    Raises ValueError for a row of another length."""
    buffers = grad_buffers(ddp)
    size = sum(b.grad_data.numel() for b in buffers)
    if tuple(total.shape) != (size + ROW_SCALARS,):
        shape = tuple(total.shape)
        raise ValueError(f"gradient row has shape {shape}, expected {size + ROW_SCALARS}")
    loss, kl, clipped, tokens = total[size:].tolist()
    normalizer = max(1.0, tokens)
    offset = 0
    for buffer in buffers:
        grad = buffer.grad_data
        part = total[offset : offset + grad.numel()].view(grad.shape)
        grad.copy_(part.to(grad.device) / normalizer)
        offset += grad.numel()
    return loss, kl, clipped, tokens


class GradientRows:
    """The gradient rows one rank computed for the step in progress."""

    def __init__(self) -> None:
        self._rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def indices(self) -> tuple[int, ...]:
        """Micro-batch indices held here, ascending."""
        return tuple(sorted(self._rows))

    def add(self, index: int, row: torch.Tensor) -> None:
        """Keep the row of micro-batch ``index``; ValueError on a repeat, a negative index or
        a row of another length than those held."""
        if index < 0 or index in self._rows:
            raise ValueError(f"micro-batch {index} already has a gradient row (or is < 0)")
        held = next(iter(self._rows.values()), None)
        if row.dim() != 1 or (held is not None and held.shape != row.shape):
            raise ValueError(f"row of micro-batch {index} has shape {tuple(row.shape)}")
        self._rows[index] = row

    def clear(self) -> None:
        """Drop every row (the step was applied, or abandoned)."""
        self._rows.clear()

    def total(
        self,
        num_micros: int,
        *,
        row_size: int,
        group: dist.ProcessGroup | None,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """The step's summed row on every rank of ``group`` (collective; None: one rank),
        on ``device`` (default: the CPU; NCCL groups need the GPU).

        Raises ValueError unless ``num_micros`` >= 1, BackendError (on every rank) unless the
        ranks together hold exactly micro-batches ``0 .. num_micros - 1``, each once, with
        rows of ``row_size``.
        """
        if num_micros < 1:
            raise ValueError(f"a step needs num_micros >= 1, got {num_micros}")
        # One count per micro-batch, and a last entry for rows this rank cannot place.
        held = torch.zeros(num_micros + 1, dtype=torch.int64, device=device)
        rows = torch.zeros(num_micros, row_size, device=device)
        for index, row in self._rows.items():
            if index >= num_micros or row.numel() != row_size:
                held[num_micros] += 1
                continue
            held[index] = 1
            rows[index] = row.to(rows.device)
        if group is not None and group.size() > 1:
            dist.all_reduce(held, group=group)
            dist.all_reduce(rows, group=group)
        counts = held.tolist()
        if counts != [1] * num_micros + [0]:
            missing = [i for i, n in enumerate(counts[:-1]) if n != 1]
            raise BackendError(
                f"the step expects micro-batches 0..{num_micros - 1} once each; missing or "
                f"repeated {missing[:8]}, {counts[-1]} rows beyond them or of another size"
            )
        total = torch.zeros(row_size, device=device)
        for index in range(num_micros):
            total += rows[index]
        return total
