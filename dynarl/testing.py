"""Test seams shipped for users: fakes, in-process transports, hypothesis strategies, and
runtime components (:class:`ScriptedRollout`, :class:`TinyTrainer`).

``FakeSGLangServer`` and ``FakeSGLangConfig`` (a loopback fake of SGLang 0.5.23's HTTP API)
are imported on first use, since they need the ``sglang`` extra (aiohttp).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec.inspect as mi
import torch
import torch.distributed as dist

from dynarl.bus.component import WorkerGroup
from dynarl.bus.messages import GenerationRequest, MetaValue, Sample, pack_tokens, unpack_tokens
from dynarl.migrate.groups import LayoutGroups
from dynarl.migrate.layout import Layout, LayoutSpec, ParamSpec, Stage
from dynarl.migrate.placement import trainer_layout
from dynarl.migrate.plan import plan_reshard
from dynarl.migrate.region import Shard
from dynarl.runtime.role import RoleContext, RoleMetrics
from dynarl.runtime.shardfile import load_shards, save_shards
from dynarl.runtime.wire import FINISH
from dynarl.types import ComponentKind

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from dynarl.backends.sglang_fake import FakeSGLangConfig, FakeSGLangServer

__all__: list[str] = [
    "FakeSGLangConfig",
    "FakeSGLangServer",
    "ScriptedRollout",
    "TinyTrainer",
    "message_strategy",
    "scripted_token",
]

_LAZY = {"FakeSGLangConfig", "FakeSGLangServer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from dynarl.backends import sglang_fake

        return getattr(sglang_fake, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_I64 = (-(2**63), 2**63 - 1)


def _bounds(info: mi.IntType) -> tuple[int, int]:
    low, high = _I64
    if info.ge is not None:
        low = max(low, info.ge)
    if info.gt is not None:
        low = max(low, info.gt + 1)
    if info.le is not None:
        high = min(high, info.le)
    if info.lt is not None:
        high = min(high, info.lt - 1)
    return low, high


def _strategy(info: mi.Type) -> SearchStrategy[Any]:
    from hypothesis import strategies as st  # a dev dependency: imported only when used

    match info:
        case mi.UnionType(types=types):
            return st.one_of(*[_strategy(member) for member in types])
        case mi.StructType(cls=cls, fields=fields):
            return st.builds(cls, **{field.name: _strategy(field.type) for field in fields})
        case mi.IntType():
            low, high = _bounds(info)
            return st.integers(min_value=low, max_value=high)
        case mi.FloatType():
            return st.floats(allow_nan=False)
        case mi.StrType():
            return st.text(max_size=16)
        case mi.BytesType():
            return st.binary(max_size=64)
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.VarTupleType(item_type=item):
            return st.lists(_strategy(item), max_size=4).map(tuple)
        case mi.DictType(key_type=key, value_type=value):
            return st.dictionaries(_strategy(key), _strategy(value), max_size=4)
        case mi.LiteralType(values=values):
            return st.sampled_from(values)
    raise NotImplementedError(f"no strategy for {info!r}")


def message_strategy(message_type: Any) -> SearchStrategy[Any]:
    """A hypothesis strategy of instances of a bus message type or union of them.

    Built from the ``msgspec`` type information, so it follows the messages as they
    change: every field gets arbitrary values of its declared type (floats without NaN,
    so that round trips compare equal). Needs hypothesis (the ``dev`` extra). Raises
    NotImplementedError for a field type it does not know.
    """
    return _strategy(mi.type_info(message_type))


# ---------------------------------------------------------------------- runtime components
# Roles for jobs run under the runtime (imported by worker processes by path, e.g.
# "dynarl.testing:ScriptedRollout"): dependency-light, deterministic, real where it counts.


def scripted_token(seed: int, sample_id: str, position: int, vocab: int) -> int:
    """The token a :class:`ScriptedRollout` emits at absolute ``position`` of a sample."""
    return zlib.crc32(f"{seed}/{sample_id}/{position}".encode()) % vocab


class ScriptedRollout(WorkerGroup, kind=ComponentKind.ROLLOUT, name="rollout"):
    """A rollout engine that plays a script (options: ``tokens_per_s``, ``kv_capacity``,
    ``vocab``, ``seed``).

    Every request generates exactly ``max_new_tokens`` tokens, one per ``1/tokens_per_s``
    seconds and sequence; the token at absolute position ``p`` of sample ``s`` is
    :func:`scripted_token` ``(seed, s, p)``, so a generation aborted and resumed elsewhere
    ends with the very tokens an uninterrupted one would. ``abort()`` makes every
    pending ``serve`` return its partial output (metadata ``finish == "abort"``). The
    utilization signal is active KV tokens (prompt plus generated, of running sequences)
    over ``kv_capacity``. Runs on the worker's event loop.
    """

    def __init__(self, ctx: RoleContext) -> None:
        options = ctx.options
        self.ctx = ctx
        self.tokens_per_s = float(options.get("tokens_per_s", 50.0) or 50.0)
        self.kv_capacity = int(options.get("kv_capacity", 4096) or 4096)
        self.vocab = int(options.get("vocab", 1000) or 1000)
        self.seed = int(options.get("seed", 0) or 0)
        self._abort = asyncio.Event()
        self._kv: dict[str, int] = {}
        self._completed = 0

    async def serve(self, item: GenerationRequest | Sample) -> Sample:
        """Generate ``item``'s tokens at the configured pace (see the class docstring)."""
        if not isinstance(item, GenerationRequest):
            raise TypeError(f"ScriptedRollout serves GenerationRequests, not {type(item)}")
        prompt = [int(t) for t in unpack_tokens(item.token_ids)]
        out: list[int] = []
        abort, sid = self._abort, item.sample_id
        self._kv[sid] = len(prompt)
        try:
            while len(out) < item.max_new_tokens and not abort.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(abort.wait(), 1.0 / self.tokens_per_s)
                    break
                out.append(scripted_token(self.seed, sid, len(prompt) + len(out), self.vocab))
                self._kv[sid] += 1
        finally:
            del self._kv[sid]
        done = len(out) >= item.max_new_tokens
        self._completed += done
        meta = {**item.metadata, FINISH: "length" if done else "abort", "device": self.ctx.device}
        return Sample(
            sample_id=sid,
            token_ids=pack_tokens(prompt + out),
            prompt_len=len(prompt),
            prompt_id=item.prompt_id,
            reward=sum(t % 2 == 0 for t in out) / max(len(out), 1) if done else None,
            metadata=meta,
        )

    async def abort(self) -> None:
        """Make every pending ``serve`` return its partial output now."""
        self._abort.set()
        self._abort = asyncio.Event()

    def metrics(self) -> RoleMetrics:
        """KV utilization, running sequences, samples finished since the last call."""
        done, self._completed = self._completed, 0
        used = sum(self._kv.values()) / self.kv_capacity
        return RoleMetrics(utilization=min(1.0, used), in_flight=len(self._kv), completed=done)


class TinyTrainer(WorkerGroup, kind=ComponentKind.TRAINER, name="trainer"):
    """A small data-parallel trainer whose state is real tensors in a real layout.

    Parameters (an embedding, ``num_layers`` square layers with biases, a head; width
    ``hidden``) and their Adam moments and step counters are placed by
    ``dynarl.migrate.trainer_layout`` over the trainer's devices — with the distributed
    optimizer (``distributed_optimizer``, default True) each DP rank owns a range of the
    moments. ``train_step`` is a deterministic Adam step (gradients from the batch, the
    same on every rank) followed by an all-reduce of the updated ranges over the DP group;
    ``checksum`` is a layout-independent digest of the whole state. P2P migration
    (``Reshardable``) and reboot (``Checkpointing``) both work. Blocking methods run on
    the worker's compute thread.
    """

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.steps = 0
        self._layout: Layout | None = None
        self._local: dict[str, torch.Tensor] = {}
        self._groups: LayoutGroups | None = None
        self._pending: tuple[Layout, dict[str, torch.Tensor]] | None = None
        self._next_groups: LayoutGroups | None = None

    @staticmethod
    def param_specs(options: Mapping[str, MetaValue]) -> list[ParamSpec]:
        """The model's parameters, in registration order."""
        hidden = int(options.get("hidden", 32) or 32)
        params = [ParamSpec(name="embed.weight", shape=(64, hidden), stage=Stage.FIRST)]
        for i in range(int(options.get("num_layers", 2) or 2)):
            params.append(ParamSpec(name=f"layers.{i}.weight", shape=(hidden, hidden), layer=i))
            params.append(ParamSpec(name=f"layers.{i}.bias", shape=(hidden,), layer=i))
        params.append(ParamSpec(name="head.weight", shape=(8, hidden), stage=Stage.LAST))
        return params

    @classmethod
    def plan_layout(cls, options: Mapping[str, MetaValue], devices: tuple[int, ...]) -> Layout:
        """The layout over ``devices`` (pure; the controller's cost model calls it too)."""
        spec = LayoutSpec(
            ranks=tuple(devices),
            dp=len(devices),
            distributed_optimizer=bool(options.get("distributed_optimizer", True)),
        )
        return trainer_layout(cls.param_specs(options), spec)

    def layout(self, devices: tuple[int, ...]) -> Layout:
        """The layout of this trainer's state over ``devices``."""
        return self.plan_layout(self.ctx.options, devices)

    async def start(self) -> None:
        """Build the initial state (seeded, identical whatever the layout)."""
        await self.ctx.compute(self._initialise)

    def _initialise(self) -> None:
        layout = self.layout(self.ctx.devices)
        assert layout.spec is not None
        seed = int(self.ctx.options.get("seed", 0) or 0)
        self._groups = LayoutGroups.build(
            self.ctx.store, layout.spec, rank=self.ctx.device, epoch=self.ctx.epoch
        )
        self._layout, self._local = layout, self._zeros(layout)
        for param in self.param_specs(self.ctx.options):
            generator = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(param.name.encode()))
            full = torch.randn(param.shape, generator=generator)
            for placement in layout.placements_on(self.ctx.device):
                if placement.shard.tensor == param.name:
                    placement.view(self._local[param.name]).copy_(
                        full[placement.shard.region.slices()]
                    )

    def _zeros(self, layout: Layout) -> dict[str, torch.Tensor]:
        shapes = layout.local_shapes_on(self.ctx.device)
        return {name: torch.zeros(shape) for name, shape in shapes.items()}

    # ------------------------------------------------------------------ Reshardable

    def shard_views(self) -> Mapping[Shard, torch.Tensor]:
        """Views of this rank's shards."""
        if self._layout is None:
            return {}
        places = self._layout.placements_on(self.ctx.device)
        return {p.shard: p.view(self._local[p.shard.tensor]) for p in places}

    def allocate(self, layout: Layout, groups: LayoutGroups | None) -> Mapping[Shard, torch.Tensor]:
        """Zeroed state for ``layout`` next to the current one; views of its shards."""
        local = self._zeros(layout)
        self._pending, self._next_groups = (layout, local), groups
        places = layout.placements_on(self.ctx.device)
        return {p.shard: p.view(local[p.shard.tensor]) for p in places}

    def commit(self, layout: Layout) -> None:
        """Switch to the allocated state; free the old one and its groups."""
        assert self._pending is not None and self._pending[0] is layout
        if self._groups is not None:
            self._groups.close()
        self._layout, self._local = self._pending
        self._groups, self._next_groups, self._pending = self._next_groups, None, None
        if self.ctx.device not in layout.ranks:
            self._layout, self._local = None, {}

    def discard(self, layout: Layout) -> None:
        """Drop what :meth:`allocate` created."""
        self._pending, self._next_groups = None, None

    # ------------------------------------------------------------------ Checkpointing

    def save_state(self, path: str) -> None:
        """Write this rank's shards under ``path``."""
        save_shards(path, self.ctx.device, self.shard_views())

    def load_state(self, path: str) -> None:
        """Fill this rank's shards from the shard files under ``path``."""
        assert self._layout is not None
        load_shards(path, self.shard_views(), self._layout.tensor_map())

    # ------------------------------------------------------------------ calls

    def train_step(self, samples: Sequence[Sample], lr: float = 1e-2) -> dict[str, MetaValue]:
        """One deterministic Adam step on the batch; the loss proxy and step count."""
        assert self._layout is not None and self._groups is not None
        tokens = [unpack_tokens(s.token_ids) for s in samples]
        signal = float(sum(t.sum() for t in tokens)) / max(1, sum(t.size for t in tokens)) / 1000
        pause = float(self.ctx.options.get("step_s", 0.0) or 0.0)
        if pause:
            time.sleep(pause)  # the test trainer's "compute": holds the compute thread
        for param in self.param_specs(self.ctx.options):
            self._adam(param.name, signal, lr)
        self.steps += 1
        first = next(iter(self._local.values()))
        return {"loss": float(first.abs().mean()), "steps": self.steps, "signal": signal}

    def _adam(self, name: str, signal: float, lr: float) -> None:
        assert self._layout is not None and self._groups is not None
        weights = self._local[name]
        grad = torch.tanh(weights) * signal + 1e-3
        update = torch.zeros_like(weights)
        for place in self._layout.placements_on(self.ctx.device):
            if place.shard.tensor != f"{name}/exp_avg":
                continue
            box = place.shard.region.slices() or ...
            m = place.view(self._local[f"{name}/exp_avg"])
            v = next(
                p.view(self._local[f"{name}/exp_avg_sq"])
                for p in self._layout.placements_on(self.ctx.device)
                if p.shard.tensor == f"{name}/exp_avg_sq" and p.shard.region == place.shard.region
            )
            g = grad[box]
            m.mul_(0.9).add_(g, alpha=0.1)
            v.mul_(0.999).addcmul_(g, g, value=0.001)
            update[box] = weights[box] - lr * m / (v.sqrt() + 1e-8)
        step = self._local.get(f"{name}/step")
        if step is not None:
            step.add_(1)
        if self._layout.spec is not None and self._layout.spec.distributed_optimizer:
            dist.all_reduce(update, group=self._groups.groups["dp"].pg)
        weights.copy_(update)

    def checksum(self, samples: Sequence[Sample]) -> dict[str, MetaValue]:
        """A digest of the whole state, the same on every rank and for every layout."""
        assert self._layout is not None and self._groups is not None
        layout, me = self._layout, self.ctx.device
        tensors = layout.tensor_map()
        whole = [Shard(tensor=t.name, rank=-1, region=t.full()) for t in layout.tensors]
        plan = plan_reshard(tensors, layout.shards, whole)
        full = {t.name: torch.zeros(t.shape) for t in layout.tensors}
        views = self.shard_views()
        for item in plan.items:
            if item.src_rank != me:
                continue
            source = next(
                s for s in views if s.tensor == item.tensor and s.region.contains(item.region)
            )
            full[item.tensor][item.region.slices() or ...] = views[source][
                item.region.relative_to(source.region).slices() or ...
            ]
        digest = hashlib.sha256()
        for name in sorted(full):
            dist.all_reduce(full[name], group=self._groups.groups["dp"].pg)
            digest.update(name.encode() + full[name].numpy().tobytes())
        return {"checksum": digest.hexdigest()[:16], "steps": self.steps}
