"""Runtime components and helpers for tests: :class:`ScriptedRollout`, :class:`TinyTrainer`,
:class:`ShadowTrainer`, :func:`message_strategy` (valid messages),
:func:`arbitrary_message_strategy` (any values, for fuzzing decoders); re-exported by
:mod:`dynarl.testing`."""

from __future__ import annotations

import asyncio
import hashlib
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dynarl.bus import GenerationRequest, MetaValue, Sample, WorkerGroup, pack_tokens, unpack_tokens
from dynarl.migrate import (
    Layout,
    LayoutGroups,
    LayoutSpec,
    ParamSpec,
    Shard,
    Stage,
    plan_reshard,
    state_tensor,
    trainer_layout,
)
from dynarl.runtime import FINISH
from dynarl.runtime.durable import load_shards, save_shards
from dynarl.runtime.worker import RoleContext, RoleMetrics
from dynarl.types import ComponentKind

if TYPE_CHECKING:
    pass

__all__ = [
    "AllReduce",
    "ScriptedRollout",
    "ShadowTrainer",
    "TinyState",
    "TinyTrainer",
    "scripted_token",
    "tiny_param_specs",
]

# ---------------------------------------------------------------------- runtime components
# Roles for jobs run under the runtime (imported by worker processes by path, e.g.
# "dynarl.testing:ScriptedRollout"): dependency-light, deterministic, real where it counts.


def scripted_token(seed: int, sample_id: str, position: int, vocab: int) -> int:
    """The token a :class:`ScriptedRollout` emits at absolute ``position`` of a sample."""
    return zlib.crc32(f"{seed}/{sample_id}/{position}".encode()) % vocab


class _Sequence:
    __slots__ = ("done", "max_new", "out", "prompt", "sample_id")

    def __init__(self, sample_id: str, prompt: list[int], max_new: int) -> None:
        self.sample_id, self.prompt, self.max_new = sample_id, prompt, max_new
        self.out: list[int] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class ScriptedRollout(WorkerGroup, kind=ComponentKind.ROLLOUT, name="rollout"):
    """A continuous-batching rollout engine that plays a script (options:
    ``tokens_per_s``, ``kv_capacity``, ``vocab``, ``seed``).

    Its ``run()`` loop is the engine: one decode step every ``1/tokens_per_s`` seconds
    gives every running sequence one token; a request finishes after exactly
    ``max_new_tokens`` tokens. The token at absolute position ``p`` of sample ``s`` is
    :func:`scripted_token` ``(seed, s, p)``, so a generation aborted and resumed elsewhere
    ends with the very tokens an uninterrupted one would. ``abort()`` makes every pending
    ``serve`` return its partial output (metadata ``finish == "abort"``). Utilization is
    active KV tokens (prompt plus generated, of running sequences) over ``kv_capacity``.
    Runs on the worker's event loop.
    """

    def __init__(self, ctx: RoleContext) -> None:
        options = ctx.options
        self.ctx = ctx
        self.tokens_per_s = float(options.get("tokens_per_s", 50.0) or 50.0)
        self.kv_capacity = int(options.get("kv_capacity", 4096) or 4096)
        self.vocab = int(options.get("vocab", 1000) or 1000)
        self.seed = int(options.get("seed", 0) or 0)
        self._running: dict[str, _Sequence] = {}
        self._completed = 0

    async def run(self) -> None:
        """The decode loop (cancelled when the role stops)."""
        while True:
            await asyncio.sleep(1.0 / self.tokens_per_s)
            for sid, seq in list(self._running.items()):
                position = len(seq.prompt) + len(seq.out)
                seq.out.append(scripted_token(self.seed, sid, position, self.vocab))
                if len(seq.out) >= seq.max_new:
                    del self._running[sid]
                    seq.done.set_result(None)

    async def serve(self, item: GenerationRequest | Sample) -> Sample:
        """Generate ``item``'s tokens (see the class docstring)."""
        if not isinstance(item, GenerationRequest):
            raise TypeError(f"ScriptedRollout serves GenerationRequests, not {type(item)}")
        prompt = [int(t) for t in unpack_tokens(item.token_ids)]
        seq = _Sequence(item.sample_id, prompt, item.max_new_tokens)
        if seq.max_new > 0:
            self._running[seq.sample_id] = seq
            try:
                await seq.done
            finally:
                self._running.pop(seq.sample_id, None)
        done = len(seq.out) >= seq.max_new
        self._completed += done
        meta = {**item.metadata, FINISH: "length" if done else "abort", "device": self.ctx.device}
        return Sample(
            sample_id=seq.sample_id,
            token_ids=pack_tokens(prompt + seq.out),
            prompt_len=len(prompt),
            prompt_id=item.prompt_id,
            reward=sum(t % 2 == 0 for t in seq.out) / max(len(seq.out), 1) if done else None,
            metadata=meta,
        )

    async def abort(self) -> None:
        """Make every pending ``serve`` return its partial output now."""
        running, self._running = self._running, {}
        for seq in running.values():
            seq.done.set_result(None)

    def metrics(self) -> RoleMetrics:
        """KV utilization, running sequences, samples finished since the last call."""
        done, self._completed = self._completed, 0
        used = sum(len(q.prompt) + len(q.out) for q in self._running.values())
        return RoleMetrics(
            utilization=min(1.0, used / self.kv_capacity),
            in_flight=len(self._running),
            completed=done,
        )


AllReduce = Callable[[torch.Tensor], None]
"""Sums a tensor over the trainer's data-parallel group, in place."""


def tiny_param_specs(options: Mapping[str, MetaValue]) -> list[ParamSpec]:
    """The parameters of a :class:`TinyTrainer` with ``options``, in registration order."""
    hidden = int(options.get("hidden", 32) or 32)
    params = [ParamSpec(name="embed.weight", shape=(64, hidden), stage=Stage.FIRST)]
    for i in range(int(options.get("num_layers", 2) or 2)):
        params.append(ParamSpec(name=f"layers.{i}.weight", shape=(hidden, hidden), layer=i))
        params.append(ParamSpec(name=f"layers.{i}.bias", shape=(hidden,), layer=i))
    params.append(ParamSpec(name="head.weight", shape=(8, hidden), stage=Stage.LAST))
    return params


class TinyState:
    """One rank's part of a :class:`TinyTrainer`'s state under one layout (plain torch).

    Every operation is elementwise on the rank's own boxes, and the only reductions sum
    values that exactly one rank contributes, so the state is bitwise the same for every
    layout: a reshard may move it, never change it.
    """

    def __init__(self, options: Mapping[str, MetaValue], layout: Layout, rank: int) -> None:
        self.options, self.layout, self.rank = options, layout, rank
        shapes = layout.local_shapes_on(rank)
        self.local = {name: torch.zeros(shape) for name, shape in shapes.items()}
        self._places = layout.placements_on(rank)

    def views(self) -> dict[Shard, torch.Tensor]:
        """Views of this rank's shards."""
        return {p.shard: p.view(self.local[p.shard.tensor]) for p in self._places}

    def initialise(self) -> None:
        """Parameters from the seed (the same whatever the layout), moments zero."""
        seed = int(self.options.get("seed", 0) or 0)
        for param in tiny_param_specs(self.options):
            generator = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(param.name.encode()))
            full = torch.randn(param.shape, generator=generator)
            for place in self._places:
                if place.shard.tensor == param.name:
                    place.view(self.local[param.name]).copy_(full[place.shard.region.slices()])

    def step(self, samples: Sequence[Sample], lr: float, all_reduce: AllReduce | None) -> float:
        """A deterministic Adam step on the batch (the same gradients on every rank)."""
        tokens = [unpack_tokens(s.token_ids) for s in samples]
        signal = float(sum(t.sum() for t in tokens)) / max(1, sum(t.size for t in tokens)) / 1000
        sharded = self.layout.spec is not None and self.layout.spec.distributed_optimizer
        for param in tiny_param_specs(self.options):
            self._adam(param.name, signal, lr, all_reduce if sharded else None)
        return signal

    def _adam(self, name: str, signal: float, lr: float, all_reduce: AllReduce | None) -> None:
        weights = self.local[name]
        grad = torch.tanh(weights) * signal + 1e-3
        update = torch.zeros_like(weights)
        second = {
            p.shard.region: p.view(self.local[p.shard.tensor])
            for p in self._places
            if p.shard.tensor == state_tensor(name, "exp_avg_sq")
        }
        for place in self._places:
            if place.shard.tensor != state_tensor(name, "exp_avg"):
                continue
            box = place.shard.region.slices() or ...
            m, v, g = (
                place.view(self.local[place.shard.tensor]),
                second[place.shard.region],
                grad[box],
            )
            m.mul_(0.9).add_(g, alpha=0.1)
            v.mul_(0.999).addcmul_(g, g, value=0.001)
            update[box] = weights[box] - lr * m / (v.sqrt() + 1e-8)
        step = self.local.get(state_tensor(name, "step"))
        if step is not None:
            step.add_(1)
        if all_reduce is not None:
            all_reduce(update)
        weights.copy_(update)

    def digest(self, all_reduce: AllReduce | None) -> dict[str, MetaValue]:
        """A digest of the whole state over every rank, and the step count."""
        layout = self.layout
        virtual = max(layout.ranks) + 1  # a rank outside the layout receives everything
        whole = [Shard(tensor=t.name, rank=virtual, region=t.full()) for t in layout.tensors]
        plan = plan_reshard(layout.tensor_map(), layout.shards, whole)
        full = {t.name: torch.zeros(t.shape) for t in layout.tensors}
        views = self.views()
        for item in plan.items:
            if item.src_rank != self.rank:
                continue
            source = next(
                s for s in views if s.tensor == item.tensor and s.region.contains(item.region)
            )
            part = views[source][item.region.relative_to(source.region).slices() or ...]
            full[item.tensor][item.region.slices() or ...] = part
        digest = hashlib.sha256()
        for name in sorted(full):
            if all_reduce is not None:
                all_reduce(full[name])
            digest.update(name.encode() + full[name].numpy().tobytes())
        steps = int(full[state_tensor(tiny_param_specs(self.options)[0].name, "step")])
        return {"checksum": digest.hexdigest()[:16], "steps": steps}


class TinyTrainer(WorkerGroup, kind=ComponentKind.TRAINER, name="trainer"):
    """A small data-parallel trainer whose state is real tensors in a real layout
    (options: ``hidden``, ``num_layers``, ``seed``, ``distributed_optimizer``, ``step_s``,
    ``group_timeout_s``: how long building its groups waits for a member, default 30).

    Parameters (an embedding, ``num_layers`` square layers with biases, a head) and their
    Adam moments and step counters are placed by ``dynarl.migrate.trainer_layout`` over
    the trainer's devices; with the distributed optimizer (the default) each DP rank owns
    a range of the moments and all-reduces its updated range over the layout's DP group.
    ``train_step`` holds the compute thread ``step_s`` seconds more (the test's stand-in
    for a long step); ``checksum`` digests the whole state; :meth:`replay` computes the
    digest a run of given batches must reach, in this process, on one rank. P2P
    migration (``Reshardable``) and reboot (``Checkpointing``) both work. Blocking methods
    run on the worker's compute thread.
    """

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self._state: TinyState | None = None
        self._groups: LayoutGroups | None = None
        self._pending: TinyState | None = None
        self._next_groups: LayoutGroups | None = None

    @classmethod
    def plan_layout(cls, options: Mapping[str, MetaValue], devices: tuple[int, ...]) -> Layout:
        """The layout over ``devices`` (pure; the controller's cost model calls it too)."""
        spec = LayoutSpec(
            ranks=tuple(devices),
            dp=len(devices),
            distributed_optimizer=bool(options.get("distributed_optimizer", True)),
        )
        return trainer_layout(tiny_param_specs(options), spec)

    @classmethod
    def replay(
        cls, options: Mapping[str, MetaValue], batches: Sequence[Sequence[Sample]], lr: float = 1e-2
    ) -> dict[str, MetaValue]:
        """The digest after training on ``batches`` in order (one rank, this process)."""
        state = TinyState(options, cls.plan_layout(options, (0,)), 0)
        state.initialise()
        for batch in batches:
            state.step(batch, lr, None)
        return state.digest(None)

    def layout(self, devices: tuple[int, ...]) -> Layout:
        """The layout of this trainer's state over ``devices``."""
        return self.plan_layout(self.ctx.options, devices)

    async def start(self) -> None:
        """Build the initial state and the layout's groups."""
        await self.ctx.compute(self._initialise)

    def _initialise(self) -> None:
        layout = self.layout(self.ctx.devices)
        assert layout.spec is not None
        timeout = timedelta(seconds=float(self.ctx.options.get("group_timeout_s", 30.0) or 30.0))
        self._groups = LayoutGroups.build(
            self.ctx.store, layout.spec, rank=self.ctx.device, epoch=self.ctx.epoch, timeout=timeout
        )
        self._state = TinyState(self.ctx.options, layout, self.ctx.device)
        self._state.initialise()

    async def close(self) -> None:
        """Free the state and the layout's groups (teardown)."""
        groups, self._groups, self._state = self._groups, None, None
        if groups is not None:
            await self.ctx.compute(groups.close)

    def _all_reduce(self) -> AllReduce:
        assert self._groups is not None
        group = self._groups.groups["dp"].pg
        return lambda tensor: dist.all_reduce(tensor, group=group)

    # ------------------------------------------------------------------ Reshardable

    def shard_views(self) -> Mapping[Shard, torch.Tensor]:
        """Views of this rank's shards (none before start or after leaving)."""
        return self._state.views() if self._state is not None else {}

    def allocate(self, layout: Layout, groups: LayoutGroups | None) -> Mapping[Shard, torch.Tensor]:
        """Zeroed state for ``layout`` next to the current one; views of its shards."""
        self._pending = TinyState(self.ctx.options, layout, self.ctx.device)
        self._next_groups = groups
        return self._pending.views()

    def commit(self, layout: Layout) -> None:
        """Switch to the allocated state; free the old one and its groups."""
        assert self._pending is not None and self._pending.layout is layout
        if self._groups is not None:
            self._groups.close()
        inside = self.ctx.device in layout.ranks
        self._state = self._pending if inside else None
        self._groups = self._next_groups
        self._pending, self._next_groups = None, None

    def discard(self, layout: Layout) -> None:
        """Drop what :meth:`allocate` created (the migration closes its groups)."""
        self._pending, self._next_groups = None, None

    # ------------------------------------------------------------------ Checkpointing

    def save_state(self, path: str) -> None:
        """Write this rank's shards under ``path``."""
        save_shards(path, self.ctx.device, self.shard_views())

    def load_state(self, path: str) -> None:
        """Fill this rank's shards from the shard files under ``path``."""
        assert self._state is not None
        load_shards(path, self._state.views(), self._state.layout.tensor_map())

    # ------------------------------------------------------------------ calls

    def train_step(self, samples: Sequence[Sample], lr: float = 1e-2) -> dict[str, MetaValue]:
        """One deterministic Adam step on the batch, on every rank at once."""
        assert self._state is not None
        pause = float(self.ctx.options.get("step_s", 0.0) or 0.0)
        if pause:
            time.sleep(pause)  # the test trainer's stand-in for a long step
        return {"signal": self._state.step(samples, lr, self._all_reduce())}

    def checksum(self, samples: Sequence[Sample]) -> dict[str, MetaValue]:
        """The digest of the whole state (the same on every rank, for every layout)."""
        assert self._state is not None
        return self._state.digest(self._all_reduce())


class ShadowTrainer(TinyTrainer, name="shadow"):
    """A second :class:`TinyTrainer` component (named ``shadow``) for jobs that need two."""
