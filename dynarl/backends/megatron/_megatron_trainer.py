"""MegatronTrainer: the production trainer on one rank — Megatron GPTModel under Megatron DDP.

One object per rank of the job, for the life of the job; it holds the state of whichever
trainer layout includes this rank (or none). :meth:`MegatronTrainer.start` builds a layout's
process groups over a ``PrefixStore`` of the job's store (NCCL on GPU, gloo on CPU), its
GPTModel on them (passed as a ``ProcessGroupCollection``; ``initialize_model_parallel`` is
never called), Megatron ``DistributedDataParallel`` and the optimizer (:mod:`.optimizer`:
Megatron's, distributed or not, on GPU; ``torch.optim.AdamW`` on ``main_grad`` on CPU).
Layouts come from :func:`dynarl.migrate.trainer_layout` over the model's description — TP,
PP, DP and, for a mixture-of-experts model, expert parallelism (CPU only) with sequence
parallelism wherever TP > 1 (:mod:`.layout_rules`) — and every build is cross-checked:
parameter shards against the model's ``sharded_state_dict()`` and, with the distributed
optimizer, flat ranges against the ones the optimizer derived.

It implements :class:`dynarl.migrate.ShardedTrainer`, so :class:`dynarl.migrate.P2PMigration`
reshards it; :meth:`gather` assembles full tensors on one rank with the same planner and
executor (weight sync, checkpoint export, state checksums). Training steps follow
``dynarl.backends.reference.Trainer``: the same global batch on every rank, micro-batch j on
data-parallel rank ``j mod dp``, losses normalised by the policy tokens of the whole batch
(so DDP sums gradients), GRPO or SFT loss. Pipeline stages are driven one micro-batch at a
time (no 1F1B interleaving; Megatron's schedules allocate on CUDA only). A streamed step
(pp=1) is cut differently: :meth:`MegatronTrainer.micro_gradient` computes one micro-batch's
gradient row (token sums, no collective over data parallelism) whenever it is complete, and
:meth:`MegatronTrainer.apply_gradient` steps with the sum of a step's rows, which the caller
forms (``dynarl.backends.megatron`` sums them in micro-batch order: bitwise the same for any
number of data-parallel ranks).

Megatron still reads a few process-wide globals (the tensor-parallel group of its
vocab-parallel cross entropy, the RNG tracker): they are pointed at the current layout
before every step and at every commit, and the model-parallel RNG tracker is re-seeded
from ``rng_seed`` whenever a layout becomes current (which on GPU also re-seeds CUDA's
default generator). Dropout is off, so no training computation draws from it.

Collective methods must be called by every rank of the current layout; all block.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from dynarl.backends._grpo import StepStats, TrainSample
from dynarl.backends.megatron._gpt_model import causal_inputs, describe, import_megatron
from dynarl.backends.megatron._grad_rows import gradient_row, row_length, write_gradient
from dynarl.backends.megatron._instance import LayoutInstance, build_instance
from dynarl.backends.megatron._layout_rules import check_layout_spec, model_layout_spec
from dynarl.backends.megatron._micro_batches import (
    LossFn,
    grpo_loss,
    logprob_gap,
    micro_tensors,
    reduce_sequence_parallel_grads,
    run_micro_batches,
    sft_loss,
)
from dynarl.backends.megatron._train_config import GPTModelConfig, MegatronTrainConfig
from dynarl.errors import BackendError
from dynarl.migrate import (
    CommGroup,
    Layout,
    LayoutGroups,
    LayoutSpec,
    ParamSpec,
    Shard,
    execute_plan,
    install_parallel_state,
    plan_reshard,
    trainer_layout,
)
from dynarl.runtime.durable import load_shards, save_shards

__all__ = ["MegatronTrainer"]

logger = logging.getLogger(__name__)


class MegatronTrainer:
    """One rank's side of a Megatron-core GPT trainer (see the module docstring).

    Needs torch.distributed initialised in this process (Megatron DDP reads it) and the
    job's ``store``. ``specs`` (the model's description) defaults to :func:`describe`.
    Raises ValueError when torch.distributed is not initialised.
    """

    def __init__(
        self,
        model: GPTModelConfig,
        config: MegatronTrainConfig,
        *,
        rank: int,
        store: Store,
        specs: Sequence[ParamSpec] | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise ValueError("MegatronTrainer needs torch.distributed initialised (DDP reads it)")
        import_megatron()
        self.model_config, self.config, self.rank, self.store = model, config, rank, store
        self.device = config.resolved_device()
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.specs: list[ParamSpec] = list(specs) if specs is not None else describe(model)
        self.version = 0
        self._current: LayoutInstance | None = None
        self._pending: LayoutInstance | None = None
        self._timeout = timedelta(seconds=config.group_timeout_s)

    # ------------------------------------------------------------------ layouts
    def layout_spec(
        self,
        ranks: Sequence[int],
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        distributed_optimizer: bool = False,
        expert_parallel: int = 1,
        expert_tensor_parallel: int | None = None,
        sequence_parallel: bool | None = None,
    ) -> LayoutSpec:
        """A :class:`LayoutSpec` with this model's parameter and master dtypes; sequence
        parallelism (None) on exactly for a MoE model with ``tp > 1``."""
        return model_layout_spec(
            self.model_config,
            ranks,
            tp=tp,
            pp=pp,
            dp=dp,
            distributed_optimizer=distributed_optimizer,
            expert_parallel=expert_parallel,
            expert_tensor_parallel=expert_tensor_parallel,
            sequence_parallel=sequence_parallel,
        )

    def layout_for(self, spec: LayoutSpec) -> Layout:
        """The trainer layout of ``spec`` for this model. Raises ValueError when the spec's
        dtypes disagree with the model, for what the device cannot run (the distributed
        optimizer on CPU, expert parallelism on CUDA), for a MoE model with TP but without
        sequence parallelism, or when the model does not split under it."""
        check_layout_spec(self.model_config, spec, self.device)
        return trainer_layout(self.specs, spec)

    @property
    def layout(self) -> Layout | None:
        """The current layout (None before :meth:`start` and on ranks outside it)."""
        return self._current.layout if self._current is not None else None

    @property
    def groups(self) -> LayoutGroups | None:
        """The current layout's process groups (None outside it)."""
        return self._current.groups if self._current is not None else None

    @property
    def module(self) -> torch.nn.Module | None:
        """This rank's GPTModel stage (None outside the current layout)."""
        return self._current.module if self._current is not None else None

    def start(self, spec: LayoutSpec, *, epoch: int) -> None:
        """Build ``spec``'s groups (named by ``epoch``), initialised model, DDP and optimizer
        and make them current. Collective over ``spec.ranks``; other ranks do nothing.
        Raises ValueError for a bad spec, BackendError when a cross-check fails."""
        layout = self.layout_for(spec)
        if self.rank not in spec.ranks:
            return
        if self._current is not None:
            raise ValueError("start() on a rank that already holds a layout; reshard instead")
        groups = LayoutGroups.build(
            self.store,
            spec,
            rank=self.rank,
            epoch=epoch,
            backend=self.backend,
            timeout=self._timeout,
        )
        try:
            self._current = self._build(layout, groups, init=True)
        except BaseException:
            groups.close()
            raise
        self._install()
        logger.info("rank %d started layout %s (epoch %d)", self.rank, layout.name, epoch)

    def _build(self, layout: Layout, groups: LayoutGroups, *, init: bool) -> LayoutInstance:
        return build_instance(
            self.model_config,
            self.config,
            layout,
            groups,
            self.specs,
            rank=self.rank,
            init=init,
            device=self.device,
            store=self.store,
            timeout=self._timeout,
            megatron_optimizer=self.device.type == "cuda",
        )

    def _install(self) -> None:
        from megatron.core import tensor_parallel

        assert self._current is not None
        install_parallel_state(self._current.groups)
        tensor_parallel.model_parallel_cuda_manual_seed(self.config.rng_seed)

    def _require(self) -> LayoutInstance:
        if self._current is None:
            raise BackendError(f"rank {self.rank} holds no part of the trainer")
        install_parallel_state(self._current.groups)  # another trainer may share the process
        return self._current

    # ------------------------------------------------------------------ ShardedTrainer
    def shard_views(self) -> Mapping[Shard, torch.Tensor]:
        """Views of this rank's shards of the current layout (empty outside it)."""
        return self._current.views(self.rank) if self._current is not None else {}

    def allocate(self, layout: Layout, groups: LayoutGroups | None) -> Mapping[Shard, torch.Tensor]:
        """Build ``layout``'s model, DDP and optimizer (zeros) on ``groups`` next to the
        current ones; their shard views. ``groups`` None (rank outside ``layout``): {}."""
        if groups is None:
            return {}
        self.discard(layout)
        self._pending = self._build(layout, groups, init=False)
        return self._pending.views(self.rank)

    def commit(self, layout: Layout) -> None:
        """Switch to the allocated layout (or to none), swap Megatron's globals, free the
        old layout's model, optimizer and groups."""
        old, new = self._current, self._pending
        assert new is None or new.layout.name == layout.name, "commit of another layout"
        self._current, self._pending = new, None
        if new is None:
            install_parallel_state(None)
        else:
            new.optimizer.commit_state()
            self._install()
            self.version = new.optimizer.step_count or self.version
        if old is not None:
            old.close()
            del old
            _collect()
        logger.info("rank %d committed layout %s", self.rank, layout.name)

    def discard(self, layout: Layout) -> None:
        """Free what :meth:`allocate` built (idempotent)."""
        if self._pending is not None:
            self._pending.close()
            self._pending = None
            _collect()

    # ------------------------------------------------------------------ training
    def set_lr(self, lr: float) -> None:
        """Use learning rate ``lr`` from the next step on; ValueError unless > 0."""
        if lr <= 0:
            raise ValueError(f"learning rate must be > 0, got {lr}")
        self._require().optimizer.set_lr(lr)

    def train_step(self, samples: Sequence[TrainSample]) -> StepStats:
        """One GRPO step on the global batch ``samples`` (collective over the layout).

        Raises ValueError on an empty batch or missing reference log-probs with a KL term,
        BackendError on a rank outside the layout.
        """
        if self.config.grpo.kl_coef > 0 and any(s.ref_logprobs is None for s in samples):
            raise ValueError("kl_coef > 0 needs ref_logprobs on every sample")
        return self._step(samples, grpo_loss(self.config))

    def sft_step(self, samples: Sequence[TrainSample]) -> StepStats:
        """One supervised step (cross entropy on ``loss_mask`` tokens); collective."""
        return self._step(samples, sft_loss)

    def _step(self, samples: Sequence[TrainSample], loss_fn: LossFn) -> StepStats:
        state = self._require()
        if not samples:
            raise ValueError("empty training batch")
        assert state.layout.spec is not None
        num_tokens = sum(sum(sample.loss_mask) for sample in samples)
        state.ddp.zero_grad_buffer()  # type: ignore[operator]
        state.optimizer.zero_grad()
        scalars = run_micro_batches(
            state.layout.spec,
            state.groups,
            state.module,
            state.ddp,
            samples,
            loss_fn=loss_fn,
            rank=self.rank,
            micro_batch_size=self.config.micro_batch_size,
            normalizer=float(max(1, num_tokens)),
            device=self.device,
        )
        state.ddp.finish_grad_sync()  # type: ignore[operator]
        reduce_sequence_parallel_grads(state.layout.spec, state.groups, state.ddp)
        grad_norm = state.optimizer.step()
        self.version += 1
        loss, kl, clipped = scalars.tolist()
        return StepStats(
            version=self.version,
            loss=loss,
            kl=kl,
            clip_fraction=clipped / max(1, num_tokens),
            num_tokens=num_tokens,
            num_samples=len(samples),
            grad_norm=grad_norm,
        )

    # ------------------------------------------------------------------ streamed steps
    @property
    def data_parallel_group(self) -> CommGroup:
        """This rank's data-parallel group of the current layout (BackendError outside it)."""
        return self._require().groups.groups["dp"]

    @property
    def row_size(self) -> int:
        """Length of this rank's gradient rows (:meth:`micro_gradient`)."""
        return row_length(self._require().ddp)

    def micro_gradient(self, samples: Sequence[TrainSample]) -> torch.Tensor:
        """The gradient row of one micro-batch of a streamed GRPO step on this rank.

        The row is this rank's flat gradient (Megatron DDP's buffers, in order) followed by
        the micro-batch's loss, KL, clipped tokens and policy tokens, all as token *sums*:
        the step divides by the policy tokens of the whole step (:meth:`apply_gradient`),
        so a row can be computed as soon as its micro-batch is complete, on any
        data-parallel rank, and the step is the sum of its rows in micro-batch order. The
        weights must not change between the rows of one step. Collective over the
        tensor-parallel group only. Raises ValueError on an empty micro-batch, missing
        reference log-probs with a KL term, or a pipeline- or expert-parallel layout (an
        expert-parallel forward pass needs every rank of its expert group at once).
        """
        state = self._require()
        spec = state.layout.spec
        assert spec is not None
        if spec.pp > 1 or spec.ep > 1:
            raise ValueError("streamed steps run on pp=1, ep=1 layouts only (use train_step)")
        if not samples:
            raise ValueError("empty micro-batch")
        if self.config.grpo.kl_coef > 0 and any(s.ref_logprobs is None for s in samples):
            raise ValueError("kl_coef > 0 needs ref_logprobs on every sample")
        state.ddp.zero_grad_buffer()  # type: ignore[operator]
        state.optimizer.zero_grad()
        tokens, mask = micro_tensors(samples, spec, device=self.device)
        logits = state.ddp(tokens, *causal_inputs(tokens))
        loss, scalars = grpo_loss(self.config)(logits, tokens, mask, samples, 1.0)
        torch.autograd.backward(loss)
        reduce_sequence_parallel_grads(spec, state.groups, state.ddp)
        count = torch.tensor([float(mask.sum())], device=self.device)
        row = gradient_row(state.ddp, scalars, count)
        state.ddp.zero_grad_buffer()  # type: ignore[operator]
        return row

    def logprob_gap(self, samples: Sequence[TrainSample]) -> float:
        """How far the engine's log-probs of ``samples`` (``old_logprobs``) are from this
        trainer's (:func:`logprob_gap`); ValueError on a pipeline- or expert-parallel
        layout too."""
        state = self._require()
        spec = state.layout.spec
        if spec is None or spec.pp > 1 or spec.ep > 1:
            raise ValueError("logprob_gap runs on pp=1, ep=1 layouts only")
        return logprob_gap(state.ddp, samples, spec, self.config.temperature, self.device)

    def apply_gradient(self, total: torch.Tensor, *, num_samples: int) -> StepStats:
        """One optimizer step with ``total``, the sum of a step's rows (the same on every
        rank of a data-parallel group): divided by the step's policy tokens, written into
        DDP's gradient buffers and stepped as :meth:`train_step` steps (clipping included;
        the norm is collective over the model-parallel group). Raises ValueError for a row
        of another size."""
        state = self._require()
        state.optimizer.zero_grad()
        loss, kl, clipped, tokens = write_gradient(state.ddp, total)
        normalizer = max(1.0, tokens)
        grad_norm = state.optimizer.step()
        state.ddp.zero_grad_buffer()  # type: ignore[operator]
        self.version += 1
        return StepStats(
            version=self.version,
            loss=loss / normalizer,
            kl=kl / normalizer,
            clip_fraction=clipped / normalizer,
            num_tokens=int(tokens),
            num_samples=num_samples,
            grad_norm=grad_norm,
        )

    # ------------------------------------------------------------------ full tensors
    def gather(self, root: int, *, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Full tensors of the current layout assembled on ``root`` (collective over the
        layout): parameters only by default, ``names`` to choose (every tensor of the
        layout: ``layout.tensor_map()``). Returns ``{name: tensor}`` on ``root`` (on this
        trainer's device), ``{}`` elsewhere. The move is planned by
        :func:`dynarl.migrate.plan_reshard` (destination: one full copy on ``root``) and
        checksummed. Raises ValueError when ``root`` is not in the layout, BackendError
        when a checksum fails."""
        state = self._require()
        layout = state.layout
        if root not in layout.ranks:
            raise ValueError(f"root {root} is not a rank of layout {layout.name}")
        wanted = set(names) if names is not None else {spec.name for spec in self.specs}
        tensors = {t.name: t for t in layout.tensors if t.name in wanted}
        destinations: dict[Shard, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for name, spec in tensors.items():
            shard = Shard(tensor=name, rank=root, region=spec.full())
            if self.rank == root:
                out[name] = torch.empty(
                    spec.shape, dtype=getattr(torch, spec.dtype), device=self.device
                )
                destinations[shard] = out[name]
        sources = {s: v for s, v in state.views(self.rank).items() if s.tensor in tensors}
        src = [p.shard for p in layout.placements if p.shard.tensor in tensors]
        plan = plan_reshard(
            tensors, src, [Shard(tensor=n, rank=root, region=t.full()) for n, t in tensors.items()]
        )
        report = execute_plan(
            plan,
            rank=self.rank,
            group=state.whole_group(self.rank),
            sources=sources,
            destinations=destinations,
            config=self.config.transfer,
        )
        if not report.verified:
            raise BackendError(
                f"gather to rank {root}: checksum mismatch in {report.mismatched[:3]}"
            )
        return out

    def state_checksum(self, root: int | None = None) -> str:
        """SHA-256 over every tensor of the trainer state (parameters, master copies, Adam
        state), unsharded, by name, and the version: the same for any layout of the same
        state. Collective over the layout; every rank gets the digest."""
        state = self._require()
        root = state.layout.ranks[0] if root is None else root
        full = self.gather(root, names=state.layout.tensor_map())
        digest = torch.zeros(32, dtype=torch.uint8, device=self.device)
        if self.rank == root:
            sha = hashlib.sha256(str(self.version).encode())
            for name in sorted(full):
                sha.update(name.encode())
                flat = full[name].detach().cpu().contiguous().reshape(-1)
                sha.update(flat.view(torch.uint8).numpy().tobytes())
            digest.copy_(torch.frombuffer(bytearray(sha.digest()), dtype=torch.uint8))
        group = state.whole_group(self.rank)
        dist.broadcast(digest, group=group.pg, group_src=group.group_rank(root))
        return bytes(digest.cpu().tolist()).hex()

    def save_sharded(self, directory: str | os.PathLike[str]) -> Path:
        """Write this rank's shards of the whole state (parameters, any master copies, Adam
        state and step) under ``directory``, one file per rank, in a form that
        :meth:`load_sharded` reads back on any layout; the file written. Local to this rank
        (every rank of the layout writes its own)."""
        state = self._require()
        return save_shards(directory, self.rank, state.views(self.rank))

    @torch.no_grad()
    def load_sharded(self, directory: str | os.PathLike[str]) -> int:
        """Fill this rank's shards of the current layout from the files
        :meth:`save_sharded` wrote under ``directory`` (by every rank of whatever layout
        wrote them), as a P2P reshard would, and take the version from Adam's step; the
        elements copied. Local to this rank; every rank of the layout must load. Raises
        ValueError when the files do not cover this rank's shards."""
        state = self._require()
        copied = load_shards(directory, state.views(self.rank), state.layout.tensor_map())
        state.optimizer.commit_state()
        self.version = state.optimizer.step_count or 0
        return copied

    @torch.no_grad()
    def load_full(self, full: Mapping[str, torch.Tensor]) -> None:
        """Overwrite this rank's shards of every layout tensor named in ``full`` (full
        tensors, cast on copy): parameters alone (master copies are then refreshed from
        them) or the whole state from :meth:`gather` (a restart). Local to this rank; every
        rank of the layout must load. Raises ValueError for a misshaped tensor or when a
        parameter this rank holds a shard of is missing."""
        state = self._require()
        layout = state.layout
        specs = layout.tensor_map()
        held = {p.shard.tensor for p in layout.placements_on(self.rank)}
        missing = [spec.name for spec in self.specs if spec.name in held and spec.name not in full]
        if missing:
            raise ValueError(f"full state lacks parameters {missing[:3]}")
        for name, tensor in full.items():
            if name in specs and tuple(tensor.shape) != specs[name].shape:
                raise ValueError(
                    f"{name}: expected shape {specs[name].shape}, got {tuple(tensor.shape)}"
                )
        tensors = state.optimizer.state_tensors()
        for placement in layout.placements_on(self.rank):
            source = full.get(placement.shard.tensor)
            if source is not None:
                region = placement.shard.region.slices() or ...
                placement.view(tensors[placement.shard.tensor]).copy_(source[region])
        state.optimizer.commit_state()
        if not any(name.endswith("/main") for name in full):
            state.optimizer.reload_params()
        if any(name.endswith("/step") for name in full):
            self.version = state.optimizer.step_count or 0

    def close(self) -> None:
        """Free the current and any allocated layout (their groups included)."""
        for state in (self._pending, self._current):
            if state is not None:
                state.close()
        if self._current is not None:
            install_parallel_state(None)
        self._current = self._pending = None
        _collect()


def _collect() -> None:
    """Free a closed layout now. Megatron's modules, DDP and optimizer reference each
    other, so the last reference to a layout's process groups sits in a cycle that only the
    garbage collector frees: without a collection here every layout change left its gloo
    contexts (a socket, a pipe pair and an epoll instance per peer and group) open until the
    collector next ran — ~6 fds a move, ~150 after 13 chaos steps."""
    gc.collect()
