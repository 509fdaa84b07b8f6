"""The Megatron-core trainer as a runtime role: :class:`MegatronTrainerRole`.

One instance per trainer device, each driving its rank of a
:class:`~dynarl.backends.megatron.MegatronTrainer` (options: a
:class:`~dynarl.backends.megatron.MegatronSetup`, ``MegatronSetup.to_options()``). The
layout over the component's devices is data parallel over what ``tp`` × ``pp`` leave. Calls
(every worker of the component at once, SPMD, on the worker's compute thread):

* ``learn(samples, old=...)``: the samples of some complete micro-batches (one prompt
  group each, its index in the ``group`` metadata); each data-parallel rank takes every
  ``dp``-th of them and keeps their gradient rows — as soon as the rollout delivers them,
  on whichever devices the trainer holds at that moment;
* ``step(num_micros=..., num_samples=...)``: the rows of every rank summed in micro-batch
  order, one optimizer step (bitwise the same whatever the data-parallel size and arrival
  order), and the state's checksum;
* ``train_step(samples)``: one whole-batch step through Megatron DDP (gradients all-reduced
  over data-parallel ranks: fast, not bitwise layout-independent);
* ``checksum``: SHA-256 of the whole state (parameters, Adam state, version), identical on
  every rank and for every layout; ``set_lr(lr=...)``.

It is :class:`~dynarl.runtime.worker.Checkpointing`: ``save_state`` writes each rank's shards
(parameters, Adam state and step) and ``load_state`` reads them back on any layout, so a
:class:`~dynarl.runtime.DurableRun` checkpoints and restores it and a reboot migration moves
it; ``train_step(samples, streamed=True)`` is the layout-independent step such a loop uses.

It is :class:`~dynarl.runtime.worker.Reshardable`: the runtime's P2P migration grows and
shrinks it (create-before-destroy; the rows of a step in progress stay with the ranks that
remain, and a rank holding rows refuses to leave). A component shrunk to no device sleeps
in place with its state (the runtime's in-place reboot) and wakes on the same devices.
``push_weights(engines=..., version=N)`` pushes the current weights to the rollout's
engines (vLLM through dynarl's worker extension, SGLang by its update-from-distributed
sequence; the engines' addresses from the serving role's ``engine_address`` call, turned
into the option by :func:`engine_targets`).

With ``grpo.kl_coef > 0`` the role scores every micro-batch under the frozen initial policy
(:class:`~dynarl.backends.megatron.ReferencePolicy`, on the devices it holds) before its
gradient row. A job that configures the trainer otherwise — the reference job, whose
weights and options are its own — subclasses the role and overrides :meth:`setup_of` and
:meth:`initial_state`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from dynarl.backends._compute_meter import ComputeMeter
from dynarl.backends._grpo import TrainSample
from dynarl.backends.megatron._grad_rows import GradientRows
from dynarl.backends.megatron._hf_checkpoint import load_hf_checkpoint, read_hf_tensors
from dynarl.backends.megatron._megatron_trainer import MegatronTrainer
from dynarl.backends.megatron._reference_policy import ReferencePolicy
from dynarl.backends.megatron._samples import micro_batches, train_sample
from dynarl.backends.megatron._setup import MegatronSetup
from dynarl.backends.megatron._sync import EngineTarget, from_hf, push_to_engines
from dynarl.bus import MetaValue, Sample, WorkerGroup
from dynarl.errors import BackendError
from dynarl.migrate import Layout, LayoutGroups, Shard
from dynarl.runtime import CallResult
from dynarl.runtime.worker import RoleContext, RoleMetrics
from dynarl.types import ComponentKind

__all__ = ["MegatronTrainerRole", "engine_targets", "engine_targets_of"]

logger = logging.getLogger(__name__)


class MegatronTrainerRole(WorkerGroup, kind=ComponentKind.TRAINER, name="trainer"):
    """The Megatron-core trainer component (see the module docstring); options: a
    :class:`~dynarl.backends.megatron.MegatronSetup` (``MegatronSetup.to_options()``)."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.setup = self.setup_of(ctx.options)
        self._trainer: MegatronTrainer | None = None
        self._policy: ReferencePolicy | None = None
        self._rows = GradientRows()
        self._meter = ComputeMeter()

    @classmethod
    def setup_of(cls, options: Mapping[str, MetaValue]) -> MegatronSetup:
        """The trainer's setup in the component's options (a :class:`MegatronSetup`)."""
        return MegatronSetup.from_options(options)

    def initial_state(self) -> Mapping[str, torch.Tensor] | None:
        """The full initial weights under GPTModel's names: the HF checkpoint at
        ``hf_path``, or None for Megatron's draw from ``init_seed``."""
        if not self.setup.hf_path:
            return None
        return from_hf(read_hf_tensors(self.setup.hf_path), self.setup.model)

    # ------------------------------------------------------------------ layouts

    @classmethod
    def plan_layout(cls, options: Mapping[str, MetaValue], devices: tuple[int, ...]) -> Layout:
        """The state's layout over ``devices`` (the controller's cost model uses it, on its
        event loop: the first call for a model describes it, importing Megatron; a driver
        calls ``MegatronSetup.param_specs()`` before the job to do that beforehand)."""
        return cls.setup_of(options).layout(devices)

    def layout(self, devices: tuple[int, ...]) -> Layout:
        """The state's layout over ``devices``."""
        return self.setup.layout(devices)

    def _ensure(self) -> MegatronTrainer:
        """This rank's trainer, created on first use (compute thread)."""
        if self._trainer is None:
            _local_world()
            if self.setup.train.device != "cpu":
                _bind_gpu(self.ctx.device)
            if self.setup.num_threads:
                torch.set_num_threads(self.setup.num_threads)
            self._trainer = MegatronTrainer(
                self.setup.model,
                self.setup.train,
                rank=self.ctx.device,
                store=self.ctx.store,
                specs=self.setup.param_specs(),
            )
        return self._trainer

    async def start(self) -> None:
        """Build the layout's groups, model, DDP and optimizer from the initial weights
        (a fresh activation; every rank of the component at once)."""
        await self.ctx.compute(self._initialise)

    def _initialise(self) -> None:
        trainer = self._ensure()
        trainer.start(self.setup.layout_spec(self.ctx.devices), epoch=self.ctx.epoch)
        if self.setup.hf_path:
            load_hf_checkpoint(trainer, self.setup.hf_path)
        elif (initial := self.initial_state()) is not None:
            trainer.load_full(initial)
        logger.info("megatron trainer rank %d: started on %s", self.ctx.device, self.ctx.devices)

    async def close(self) -> None:
        """Free the state and its groups (teardown)."""
        trainer, self._trainer = self._trainer, None
        self._rows.clear()
        self._drop_policy()
        if trainer is not None:
            await self.ctx.compute(trainer.close)

    # ------------------------------------------------------------------ Reshardable

    def shard_views(self) -> Mapping[Shard, torch.Tensor]:
        """Views of this rank's shards (none when it holds no state)."""
        return self._trainer.shard_views() if self._trainer is not None else {}

    def allocate(self, layout: Layout, groups: LayoutGroups | None) -> Mapping[Shard, torch.Tensor]:
        """Zeroed state for ``layout`` next to the current one; views of its shards.

        Raises BackendError on a rank that would leave while holding gradient rows of the
        step in progress (they would be lost).
        """
        if groups is None:
            if len(self._rows):
                raise BackendError(
                    f"trainer rank {self.ctx.device} holds {len(self._rows)} gradient rows "
                    "of the step in progress: it cannot leave before the step"
                )
            return {}
        return self._ensure().allocate(layout, groups)

    def commit(self, layout: Layout) -> None:
        """Switch to the allocated state (its version from the step counters); free the old."""
        if self._trainer is not None:
            self._trainer.commit(layout)
        self._drop_policy()  # rebuilt on the new layout when next needed
        if self.ctx.device not in layout.ranks:
            self._rows.clear()

    def discard(self, layout: Layout) -> None:
        """Free what :meth:`allocate` built."""
        if self._trainer is not None:
            self._trainer.discard(layout)

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> RoleMetrics:
        """Busy share of the compute thread since the last call, micro-batches done."""
        return self._meter.reading()

    # ------------------------------------------------------------------ calls

    def _current(self) -> MegatronTrainer:
        if self._trainer is None or self._trainer.layout is None:
            raise BackendError(f"trainer rank {self.ctx.device} holds no state")
        return self._trainer

    def _train_samples(self, samples: Sequence[Sample], old: str) -> list[TrainSample]:
        """``samples`` as TrainSamples, scored by the reference policy when the loss has a
        KL term (the policy built on the current layout on first use)."""
        batch = [train_sample(sample, old=old) for sample in samples]
        if self.setup.train.grpo.kl_coef <= 0:
            return batch
        trainer = self._current()
        assert trainer.layout is not None
        if self._policy is None or self._policy.layout_name != trainer.layout.name:
            self._drop_policy()
            self._policy = ReferencePolicy(trainer, self.initial_state())
        return self._policy.score(batch)

    def _drop_policy(self) -> None:
        policy, self._policy = self._policy, None
        if policy is not None:
            policy.close()

    def learn(
        self,
        samples: Sequence[Sample],
        *,
        old: str = "current",
        num_samples: int = 0,
        logprob_gap: bool = False,
    ) -> dict[str, MetaValue]:
        """Compute and keep the gradient rows of this rank's share of the complete
        micro-batches in ``samples`` (see the module docstring). ``old``: ``current``
        (on-policy ratio 1) or ``rollout`` (ratios against the samples' log-probs).
        ``num_samples`` is accepted as the reference trainer's ``learn`` takes it, and not
        used: the step's loss is normalised by its policy tokens, known at ``step``.
        ``logprob_gap``: also answer the largest gap between the log-probs the rollout
        reported for those samples' policy tokens and the trainer's own, teacher-forced
        (an extra forward pass; ``logprob_gap`` in the reply, 0.0 for no sample). Raises
        ValueError for a sample without a micro-batch or one already learned here."""
        trainer = self._current()
        group = trainer.data_parallel_group
        micros = micro_batches(samples)
        mine = list(micros)[group.group_rank(self.ctx.device) :: len(group.ranks)]
        held = [index for index in mine if index in self._rows.indices]
        if held:
            raise ValueError(f"micro-batches {held} already have gradient rows here")
        began = self._meter.begin(len(mine))
        gap = 0.0
        try:
            for index in mine:
                batch = self._train_samples(micros[index], old)
                if logprob_gap:
                    rollout = [train_sample(sample, old="rollout") for sample in micros[index]]
                    gap = max(gap, trainer.logprob_gap(rollout))
                self._rows.add(index, trainer.micro_gradient(batch))
                self._meter.dequeue()
        finally:
            self._meter.account(began, len(mine))
        out: dict[str, MetaValue] = {"computed": ",".join(map(str, mine)), "rows": len(self._rows)}
        if logprob_gap:
            out["logprob_gap"] = gap
        return out

    def step(
        self,
        samples: Sequence[Sample],
        *,
        num_micros: int,
        num_samples: int = 0,
        checksum: bool = True,
    ) -> dict[str, MetaValue]:
        """Sum every rank's rows in micro-batch order and take one optimizer step
        (collective over the layout); the step's figures and, with ``checksum``, the new
        state's. Raises BackendError unless the ranks hold exactly micro-batches
        ``0 .. num_micros - 1`` (the rows are then kept)."""
        trainer = self._current()
        began = self._meter.begin()
        try:
            total = self._rows.total(
                num_micros,
                row_size=trainer.row_size,
                group=trainer.data_parallel_group.pg,
                device=trainer.device,
            )
            stats = trainer.apply_gradient(total, num_samples=num_samples)
            self._rows.clear()
            out: dict[str, MetaValue] = {
                "version": stats.version,
                "loss": stats.loss,
                "kl": stats.kl,
                "clip_fraction": stats.clip_fraction,
                "grad_norm": stats.grad_norm,
                "num_tokens": stats.num_tokens,
            }
            if checksum:
                out["checksum"] = trainer.state_checksum()
        finally:
            self._meter.account(began, 0)
        return out

    def train_step(
        self, samples: Sequence[Sample], *, old: str = "current", streamed: bool = False
    ) -> dict[str, MetaValue]:
        """One whole-batch GRPO step on ``samples`` (in the order given, the same on every
        rank) through Megatron DDP. With ``streamed`` the step is :meth:`learn` on every
        micro-batch of ``samples`` then :meth:`step`: slower, but bitwise the same for any
        data-parallel size (a loop that may train on either side of a move, and must match
        an uninterrupted run, wants it; every sample needs its ``group`` metadata). Raises
        ValueError while rows of a streamed step are held here, or for an empty batch."""
        trainer = self._current()
        if len(self._rows):
            raise ValueError("a streamed step is in progress (rows held): call step first")
        if streamed:
            if not samples:
                raise ValueError("train_step: empty batch")
            self.learn(samples, old=old)
            num_micros = len(micro_batches(samples))
            return self.step(samples, num_micros=num_micros, num_samples=len(samples))
        began = self._meter.begin(1)
        try:
            stats = trainer.train_step(self._train_samples(samples, old))
        finally:
            self._meter.account(began, 1)
        return {
            "version": stats.version,
            "loss": stats.loss,
            "kl": stats.kl,
            "clip_fraction": stats.clip_fraction,
            "grad_norm": stats.grad_norm,
            "num_tokens": stats.num_tokens,
        }

    # ------------------------------------------------------------------ Checkpointing

    def save_state(self, path: str) -> None:
        """Write this rank's shards of the whole state under directory ``path`` (the
        durable run's checkpoints, the reboot migration). Raises BackendError on a rank
        holding no state, ValueError while rows of a streamed step are held (a checkpoint
        is taken between steps)."""
        if len(self._rows):
            raise ValueError(
                f"trainer rank {self.ctx.device} holds {len(self._rows)} gradient rows: "
                "checkpoint between steps"
            )
        self._current().save_sharded(path)

    def load_state(self, path: str) -> None:
        """Restore the whole state from the shard files under ``path``, whatever layout
        wrote them (every rank of the current layout loads). Raises ValueError when they do
        not cover this rank's shards."""
        self._rows.clear()
        self._drop_policy()
        self._current().load_sharded(path)

    def push_weights(
        self,
        samples: Sequence[Sample],
        *,
        engines: str,
        version: int,
        host: str = "127.0.0.1",
        backend: str = "gloo",
    ) -> dict[str, MetaValue]:
        """Push the current weights to the rollout's engines as ``version`` (every rank of
        the trainer: the gather is collective; the layout's first rank pushes, hosting the
        groups on ``host``, an address the engines reach). ``engines``: a JSON list of what
        the serving role's ``engine_address`` call answers (``kind`` and ``url`` of each;
        :func:`engine_targets` makes it). Raises ValueError for unreadable ``engines`` or an
        in-process engine (no URL), BackendError when an engine refuses or its weights
        differ afterwards."""
        targets = engine_targets_of(engines)
        trainer = self._current()
        asyncio.run(push_to_engines(trainer, targets, str(version), host=host, backend=backend))
        return {"version": version, "engines": len(targets)}

    def set_lr(self, samples: Sequence[Sample], *, lr: float) -> dict[str, MetaValue]:
        """Use learning rate ``lr`` from the next step on (ValueError unless > 0)."""
        self._current().set_lr(lr)
        return {"lr": lr}

    def checksum(self, samples: Sequence[Sample]) -> dict[str, MetaValue]:
        """SHA-256 of the whole state (collective), the weight version and the rows held."""
        trainer = self._current()
        return {
            "checksum": trainer.state_checksum(),
            "version": trainer.version,
            "rows": len(self._rows),
        }


def engine_targets(addresses: Sequence[CallResult]) -> str:
    """The ``engines`` option of :meth:`MegatronTrainerRole.push_weights` from the results
    of a serving component's ``engine_address`` call (one per device, in device order)."""
    ordered = sorted(addresses, key=lambda result: result.device)
    return json.dumps([{"kind": r.values.get("kind"), "url": r.values.get("url")} for r in ordered])


def engine_targets_of(engines: str) -> list[EngineTarget]:
    """:func:`engine_targets`' text back as targets; ValueError naming what is wrong."""
    try:
        entries = json.loads(engines)
        targets = [EngineTarget(kind=e["kind"], url=e["url"]) for e in entries]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"push_weights: engines must be engine_targets' JSON list: {exc}") from exc
    if not targets:
        raise ValueError("push_weights: no engines to push to")
    return targets


def _bind_gpu(device: int) -> None:
    """On a machine with GPUs, make this worker's own GPU the current one — on the calling
    thread, the compute thread every trainer call and reshard runs on (CUDA's current device
    is per thread): the node-local index (``LOCAL_RANK`` under torchrun, else the job's
    device id) modulo the GPUs this process sees. Two ranks of an NCCL group cannot share a
    GPU, so without this every worker would train on GPU 0."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", device))
        torch.cuda.set_device(local % torch.cuda.device_count())


def _local_world() -> None:
    """Give this process a one-rank default process group if it has none (idempotent).

    Megatron DDP reads the default group; the trainer builds its real groups explicitly
    over the job's store and needs only this local stand-in (an in-memory store).
    """
    if not dist.is_initialized():
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
