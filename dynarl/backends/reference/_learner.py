"""The trainer component of a reference job: :class:`ReferenceTrainer`.

One instance per trainer device (data parallel, TP 1, every rank a full replica of the
parameters and the Adam state). It takes GRPO steps as *streams of micro-batches*:

* ``learn(samples, num_samples=...)`` (every rank, SPMD): the samples of some complete
  micro-batches (a micro-batch is one prompt group, its index in the ``group`` metadata);
  each rank takes every ``dp``-th of them, scores them under the frozen reference policy
  (the KL term; the trainer's colocated inference work), computes their gradient rows and
  keeps them (:class:`~._accumulate.GradientBook`) — as soon as the rollout delivers them,
  on whichever devices the trainer holds at that moment;
* ``step(num_micros=..., ...)``: the rows of every rank summed in micro-batch order, one
  Adam step: bitwise the same update whatever the devices, DP size and arrival order;
* ``sync_weights(rollout=..., tag=...)``: the new parameters to the rollout devices,
  planned by the migrate planner (replicated destination layout);
* ``checksum``: SHA-256 of the whole state (identical on every rank).

It is :class:`~dynarl.runtime.worker.Reshardable`: the runtime's P2P migration grows and shrinks
it (create-before-destroy, the kept rows stay with the ranks that remain; a rank holding
rows refuses to leave). Blocking methods run on the worker's compute thread.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch

from dynarl.backends._compute_meter import ComputeMeter
from dynarl.backends._grpo import TrainSample
from dynarl.backends.reference._accumulate import GradientBook
from dynarl.backends.reference._gpt import local_world
from dynarl.backends.reference._logprob import LogProbWorker
from dynarl.backends.reference._samples import (
    GROUP,
    SEED_ID,
    policy_mask,
    to_train_sample,
    unpack_floats,
)
from dynarl.backends.reference._setup import ReferenceSetup
from dynarl.backends.reference._trainer import Trainer, state_checksum
from dynarl.backends.reference._weights import (
    WEIGHTS_SLOT,
    run_sync,
    sync_plan,
    trainer_state_layout,
)
from dynarl.bus import MetaValue, Sample, WorkerGroup
from dynarl.errors import BackendError
from dynarl.migrate import Layout, LayoutGroups, Shard, state_tensor
from dynarl.runtime.worker import RoleContext, RoleMetrics
from dynarl.types import ComponentKind

__all__ = ["ReferenceTrainer"]

logger = logging.getLogger(__name__)


class _Rank:
    """One layout's trainer on this rank: groups, model, optimizer, reference scorer."""

    def __init__(self, setup: ReferenceSetup, layout: Layout, groups: LayoutGroups) -> None:
        local_world()
        self.layout, self.groups = layout, groups
        tp, dp = groups.groups["tp"].pg, groups.groups["dp"].pg
        self.trainer = Trainer(setup.model, setup.train, tp_group=tp, dp_group=dp)
        for param in self.trainer.model.parameters():  # Adam's state, materialised
            self.trainer.optimizer.state[param] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param),
            }
        self.reference: LogProbWorker | None = None
        if setup.train.grpo.kl_coef > 0:
            self.reference = LogProbWorker(
                setup.model, tp_group=tp, micro_batch_size=64, temperature=setup.temperature
            )
            self.reference.load_weights(setup.initial_weights(), 0)

    def locals(self) -> dict[str, torch.Tensor]:
        """This rank's local tensor of every name in the layout."""
        out: dict[str, torch.Tensor] = {}
        trainer = self.trainer
        for name, param in trainer.model.named_parameters():
            state = trainer.optimizer.state[param]
            out[name] = param.detach()
            for key in ("exp_avg", "exp_avg_sq", "step"):
                out[state_tensor(name, key)] = state[key]
        return out

    def views(self, rank: int) -> dict[Shard, torch.Tensor]:
        tensors = self.locals()
        return {p.shard: p.view(tensors[p.shard.tensor]) for p in self.layout.placements_on(rank)}

    def close(self) -> None:
        self.groups.close()


class ReferenceTrainer(WorkerGroup, kind=ComponentKind.TRAINER, name="trainer"):
    """The reference job's trainer (see the module docstring); options: a
    :class:`~dynarl.backends.reference.ReferenceSetup` (``ReferenceSetup.to_options()``)."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.setup = ReferenceSetup.from_options(ctx.options)
        self._rank: _Rank | None = None
        self._pending: _Rank | None = None
        self._book: GradientBook | None = None
        self._meter = ComputeMeter()

    # ------------------------------------------------------------------ layouts

    @classmethod
    def plan_layout(cls, options: Mapping[str, MetaValue], devices: tuple[int, ...]) -> Layout:
        """The state's layout over ``devices`` (pure; the controller's cost model uses it)."""
        return trainer_state_layout(ReferenceSetup.from_options(options).model, devices)

    def layout(self, devices: tuple[int, ...]) -> Layout:
        """The state's layout over ``devices``."""
        return trainer_state_layout(self.setup.model, devices)

    async def start(self) -> None:
        """Build the groups and the state from the initial weights (a fresh activation)."""
        await self.ctx.compute(self._initialise)

    def _initialise(self) -> None:
        layout = self.layout(self.ctx.devices)
        assert layout.spec is not None
        groups = LayoutGroups.build(
            self.ctx.store, layout.spec, rank=self.ctx.device, epoch=self.ctx.epoch
        )
        rank = _Rank(self.setup, layout, groups)
        rank.trainer.model.load_full_state_dict(self.setup.initial_weights())
        self._rank = rank
        self._book = GradientBook(rank.trainer.row_size)
        logger.info("trainer rank %d: started on %s", self.ctx.device, self.ctx.devices)

    async def close(self) -> None:
        """Free the state and its groups (teardown)."""
        rank, self._rank = self._rank, None
        if rank is not None:
            await self.ctx.compute(rank.close)

    # ------------------------------------------------------------------ Reshardable

    def shard_views(self) -> Mapping[Shard, torch.Tensor]:
        """Views of this rank's shards (none when it holds no state)."""
        return self._rank.views(self.ctx.device) if self._rank is not None else {}

    def allocate(self, layout: Layout, groups: LayoutGroups | None) -> Mapping[Shard, torch.Tensor]:
        """Zeroed state for ``layout`` next to the current one; views of its shards.

        Raises BackendError on a rank that would leave while holding gradient rows of the
        step in progress (they would be lost).
        """
        if groups is None:
            if self._book is not None and len(self._book):
                raise BackendError(
                    f"trainer rank {self.ctx.device} holds {len(self._book)} gradient rows "
                    "of the step in progress: it cannot leave before the step"
                )
            return {}
        pending = _Rank(self.setup, layout, groups)
        for tensor in pending.locals().values():
            tensor.zero_()
        self._pending = pending
        return pending.views(self.ctx.device)

    def commit(self, layout: Layout) -> None:
        """Switch to the allocated state (its version from the step counters); free the old."""
        old, self._rank = self._rank, None
        if old is not None:
            old.close()
        if self.ctx.device in layout.ranks:
            assert self._pending is not None and self._pending.layout is layout
            rank = self._pending
            first = next(iter(rank.trainer.model.parameters()))
            rank.trainer.version = int(rank.trainer.optimizer.state[first]["step"])
            self._rank = rank
            if self._book is None:
                self._book = GradientBook(rank.trainer.row_size)
        else:
            self._book = None
        self._pending = None

    def discard(self, layout: Layout) -> None:
        """Drop what :meth:`allocate` created (the migration closes its groups)."""
        self._pending = None

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> RoleMetrics:
        """Busy share of the compute thread since the last call, micro-batches done."""
        return self._meter.reading()

    # ------------------------------------------------------------------ calls

    def _current(self) -> _Rank:
        if self._rank is None or self._book is None:
            raise BackendError(f"trainer rank {self.ctx.device} holds no state")
        return self._rank

    def learn(
        self, samples: Sequence[Sample], *, num_samples: int, old: str = "current"
    ) -> dict[str, MetaValue]:
        """Compute and keep the gradient rows of this rank's share of the complete
        micro-batches in ``samples`` (see the module docstring). ``old``: ``current``
        (on-policy ratio 1) or ``rollout`` (ratios against the log-probs the samples were
        generated with). Raises ValueError for a micro-batch already learned here."""
        began = self._meter.begin()
        rank = self._current()
        assert self._book is not None
        groups: dict[int, list[Sample]] = defaultdict(list)
        for sample in samples:
            group = sample.metadata.get(GROUP)
            if not isinstance(group, int):
                raise ValueError(f"sample {sample.sample_id} has no micro-batch ({GROUP!r})")
            groups[group].append(sample)
        indices = sorted(groups)
        dp, me = rank.trainer.dp_size, rank.trainer.dp_rank
        mine = indices[me::dp]
        self._meter.queue(len(mine))
        for index in mine:
            micro = sorted(groups[index], key=_seed_id)
            batch = self._train_samples(rank, micro, old)
            self._book.add(index, rank.trainer.micro_gradient(batch, num_samples=num_samples))
            self._meter.dequeue()
        self._meter.account(began, len(mine))
        return {"computed": ",".join(map(str, mine)), "rows": len(self._book)}

    def _train_samples(self, rank: _Rank, micro: Sequence[Sample], old: str) -> list[TrainSample]:
        ref: list[tuple[float, ...]] | None = None
        if rank.reference is not None:
            tokens = [tuple(int(t) for t in _tokens(s)) for s in micro]
            ref = rank.reference.compute(tokens)
        out = []
        for i, sample in enumerate(micro):
            olds = _rollout_logprobs(sample) if old == "rollout" else None
            out.append(
                to_train_sample(
                    sample, old_logprobs=olds, ref_logprobs=None if ref is None else ref[i]
                )
            )
        return out

    def step(
        self, samples: Sequence[Sample], *, num_micros: int, num_samples: int, num_tokens: int = 0
    ) -> dict[str, MetaValue]:
        """Sum every rank's rows in micro-batch order and take one Adam step (collective
        over the trainer's DP group). Raises BackendError unless the ranks hold exactly
        micro-batches ``0 .. num_micros - 1``."""
        began = self._meter.begin()
        rank = self._current()
        assert self._book is not None
        dp_group = rank.groups.groups["dp"].pg
        total = self._book.total(
            num_micros, group=dp_group, deterministic=self.setup.train.deterministic
        )
        stats = rank.trainer.apply_gradient(total, num_samples=num_samples, num_tokens=num_tokens)
        self._book.clear()
        self._meter.account(began, 0)
        return {
            "version": stats.version,
            "loss": stats.loss,
            "kl": stats.kl,
            "clip_fraction": stats.clip_fraction,
            "grad_norm": stats.grad_norm,
            "checksum": state_checksum(rank.trainer.full_state()),
        }

    def sync_weights(
        self, samples: Sequence[Sample], *, rollout: str, tag: str
    ) -> dict[str, MetaValue]:
        """Send the parameters to the rollout devices ``rollout`` (``"0,1"``), planned by
        the migrate planner; a copy for this process's own (sleeping) engine goes to the
        worker's shared slot."""
        began = self._meter.begin()
        rank = self._current()
        devices = [int(d) for d in rollout.split(",") if d]
        plan = sync_plan(self.setup.model, self.ctx.devices, devices)
        sources = {name: p.detach() for name, p in rank.trainer.model.named_parameters()}
        result = run_sync(
            plan,
            model=self.setup.model,
            rank=self.ctx.device,
            store=self.ctx.store,
            tag=tag,
            sources=sources,
        )
        version = rank.trainer.version
        if result.state:
            self.ctx.shared[WEIGHTS_SLOT] = (version, result.state)
        self._meter.account(began, 0)
        sent = result.report.bytes_sent if result.report is not None else 0
        return {"version": version, "bytes_sent": sent, "local": bool(result.state)}

    def checksum(self, samples: Sequence[Sample]) -> dict[str, MetaValue]:
        """SHA-256 of the whole state, the weight version and the rows held here."""
        rank = self._current()
        assert self._book is not None
        return {
            "checksum": state_checksum(rank.trainer.full_state()),
            "version": rank.trainer.version,
            "rows": len(self._book),
        }


def _seed_id(sample: Sample) -> int:
    value = sample.metadata.get(SEED_ID)
    return int(value) if isinstance(value, int) else int(sample.sample_id)


def _tokens(sample: Sample) -> list[int]:
    from dynarl.bus import unpack_tokens

    return [int(t) for t in unpack_tokens(sample.token_ids)]


def _rollout_logprobs(sample: Sample) -> list[float]:
    """Per target over all tokens: the log-prob each policy token was sampled with."""
    generated = iter(unpack_floats(sample.logprobs))
    out = [0.0] * (sample.prompt_len - 1)
    for is_policy in policy_mask(sample):
        out.append(next(generated, 0.0) if is_policy else 0.0)
    return out
