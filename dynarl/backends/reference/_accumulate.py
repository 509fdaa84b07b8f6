"""Micro-batch gradients kept as they are computed, summed in a fixed order at the step.

A streamed GRPO step (one optimizer update per step, on-policy) is the sum of the
gradient rows of its micro-batches, whose composition is fixed by sample id (micro-batch
``j`` = the samples of prompt group ``j``). A :class:`GradientBook` keeps the rows one
data-parallel rank computed — in whatever order the micro-batches completed, while the
trainer held one device or several — and :meth:`GradientBook.total` produces the step's
sum on every rank:

* **deterministic**: the rows are all-gathered over the data-parallel group (their
  indices first, then the rows, padded to the largest count) and summed in micro-batch
  order ``0, 1, ..., M-1`` on every rank. The result is the same float sequence whatever
  the DP size, whichever rank computed which row and in which order they arrived: a
  streamed step is bitwise equal to a static one.
* **fast**: each rank sums its rows in arrival order, then one all-reduce.

Runs on the trainer's compute thread; ``total`` is collective over the DP group.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist

from dynarl.errors import BackendError

__all__ = ["GradientBook"]

logger = logging.getLogger(__name__)


class GradientBook:
    """The gradient rows one rank computed for the step in progress."""

    def __init__(self, row_size: int) -> None:
        self.row_size = row_size
        self._rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def indices(self) -> tuple[int, ...]:
        """Micro-batch indices held here, ascending."""
        return tuple(sorted(self._rows))

    def add(self, index: int, row: torch.Tensor) -> None:
        """Keep the row of micro-batch ``index``; raises ValueError on a repeat or bad shape."""
        if index in self._rows:
            raise ValueError(f"micro-batch {index} already has a gradient row")
        if row.shape != (self.row_size,):
            raise ValueError(f"row of micro-batch {index} has shape {tuple(row.shape)}")
        self._rows[index] = row

    def clear(self) -> None:
        """Drop every row (the step was applied, or abandoned)."""
        self._rows.clear()

    def total(
        self, num_micros: int, *, group: dist.ProcessGroup | None, deterministic: bool
    ) -> torch.Tensor:
        """The step's summed row on every rank of ``group`` (collective; None: one rank).

        Raises BackendError unless the ranks together hold exactly micro-batches
        ``0 .. num_micros - 1``, each once.
        """
        if deterministic:
            rows = self._gathered(group)
            _check_complete(rows.keys(), num_micros)
            total = rows[0].clone()
            for index in range(1, num_micros):
                total += rows[index]
            return total
        counts = torch.tensor([len(self._rows), sum(self._rows)], dtype=torch.int64)
        total = torch.zeros(self.row_size)
        for index in self._rows:  # arrival order (dicts keep insertion order)
            total += self._rows[index]
        if group is not None and group.size() > 1:
            dist.all_reduce(counts, group=group)
            dist.all_reduce(total, group=group)
        if int(counts[0]) != num_micros or int(counts[1]) != num_micros * (num_micros - 1) // 2:
            raise BackendError(f"the step expects {num_micros} micro-batches, ranks hold {counts}")
        return total

    def _gathered(self, group: dist.ProcessGroup | None) -> dict[int, torch.Tensor]:
        if group is None or group.size() == 1:
            return dict(self._rows)
        size = group.size()
        mine = torch.tensor([len(self._rows)], dtype=torch.int64)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(counts, mine, group=group)
        width = max(int(c) for c in counts)
        if width == 0:
            return {}
        indices = torch.full((width,), -1, dtype=torch.int64)
        rows = torch.zeros(width, self.row_size)
        for slot, index in enumerate(self.indices):
            indices[slot] = index
            rows[slot] = self._rows[index]
        all_indices = [torch.empty_like(indices) for _ in range(size)]
        all_rows = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(all_indices, indices, group=group)
        dist.all_gather(all_rows, rows, group=group)
        out: dict[int, torch.Tensor] = {}
        for idx, block in zip(all_indices, all_rows, strict=True):
            for slot, index in enumerate(idx.tolist()):
                if index < 0:
                    continue
                if index in out:
                    raise BackendError(f"micro-batch {index} was computed on two ranks")
                out[index] = block[slot]
        return out


def _check_complete(indices: Iterable[int], num_micros: int) -> None:
    have = sorted(indices)
    if have != list(range(num_micros)):
        missing = sorted(set(range(num_micros)) - set(have))
        raise BackendError(
            f"the step expects micro-batches 0..{num_micros - 1}; missing {missing[:8]}, "
            f"held {len(have)}"
        )
