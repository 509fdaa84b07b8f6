"""The reference GPT: a small decoder built from Megatron-core tensor-parallel layers.

Why these layers and not Megatron's ``GPTModel``: every layer here takes its
tensor-parallel process group at construction (``tp_group=``), so a trainer whose layout
changes at run time rebuilds its module over new groups without touching
``parallel_state``'s globals; the parameter layout is ours (one fused, head-interleaved
QKV; learned positions; no weight tying), which maps one-to-one onto the rollout
engine's batch-invariant decoder (:mod:`._decoder`) and onto per-tensor shard specs
(:func:`param_layout`) that a resharding planner can read; and nothing depends on
Megatron's CUDA-oriented inference contexts. The layers themselves — VocabParallelEmbedding,
ColumnParallelLinear, RowParallelLinear and the mappings between them — are Megatron's,
unchanged, on CPU through :mod:`dynarl.backends._cpu_compat`.

Initialisation draws each parameter's full (unsharded) value from a generator keyed by
(seed, parameter name) and keeps this rank's slice, so every tensor-parallel layout
starts from the same weights. Megatron reads ``torch.distributed.is_initialized()``:
build models only after the process joined a (possibly one-rank) job, see
:func:`solo_process_group`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dynarl.backends._cpu_compat import apply_cpu_shim

apply_cpu_shim()

from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402

__all__ = [
    "GPTConfig",
    "ParallelGPT",
    "ParamShard",
    "check_full_state",
    "local_world",
    "param_layout",
    "solo_process_group",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Architecture of the reference GPT (pre-LayerNorm, GELU MLP, learned positions)."""

    vocab_size: int = 64
    """Number of token ids; divisible by every tensor-parallel size used."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads; divisible by every tensor-parallel size used."""
    ffn_hidden_size: int = 256
    """Width of the MLP."""
    max_seq_len: int = 256
    """Positions the model has embeddings for."""
    layernorm_eps: float = 1e-5
    """LayerNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of matrices and embeddings."""
    seed: int = 0
    """Initialisation seed."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError("GPTConfig.hidden_size must be divisible by num_heads")
        if self.max_seq_len < 2:
            raise ValueError(f"GPTConfig.max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.init_std <= 0 or self.layernorm_eps <= 0:
            raise ValueError("GPTConfig.init_std and layernorm_eps must be > 0")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    def check_tp(self, tp: int) -> None:
        """Raise ValueError unless heads, vocabulary and MLP split evenly over ``tp`` ranks."""
        for name in ("vocab_size", "num_heads", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} not divisible by tp={tp}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamShard:
    """How one parameter is laid out across tensor-parallel ranks."""

    name: str
    """Parameter name (as in ``named_parameters()``)."""
    full_shape: tuple[int, ...]
    """Shape of the unsharded tensor."""
    partition_dim: int | None
    """Dimension split evenly and contiguously across TP ranks; None if replicated."""


def param_layout(config: GPTConfig) -> tuple[ParamShard, ...]:
    """Every parameter of :class:`ParallelGPT`, in ``named_parameters()`` order."""
    h, f, v = config.hidden_size, config.ffn_hidden_size, config.vocab_size
    shards = [
        ParamShard(name="embedding.weight", full_shape=(v, h), partition_dim=0),
        ParamShard(name="position.weight", full_shape=(config.max_seq_len, h), partition_dim=None),
    ]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shards += [
            ParamShard(name=p + "ln1.weight", full_shape=(h,), partition_dim=None),
            ParamShard(name=p + "ln1.bias", full_shape=(h,), partition_dim=None),
            ParamShard(name=p + "qkv.weight", full_shape=(3 * h, h), partition_dim=0),
            ParamShard(name=p + "qkv.bias", full_shape=(3 * h,), partition_dim=0),
            ParamShard(name=p + "proj.weight", full_shape=(h, h), partition_dim=1),
            ParamShard(name=p + "proj.bias", full_shape=(h,), partition_dim=None),
            ParamShard(name=p + "ln2.weight", full_shape=(h,), partition_dim=None),
            ParamShard(name=p + "ln2.bias", full_shape=(h,), partition_dim=None),
            ParamShard(name=p + "fc1.weight", full_shape=(f, h), partition_dim=0),
            ParamShard(name=p + "fc1.bias", full_shape=(f,), partition_dim=0),
            ParamShard(name=p + "fc2.weight", full_shape=(h, f), partition_dim=1),
            ParamShard(name=p + "fc2.bias", full_shape=(h,), partition_dim=None),
        ]
    shards += [
        ParamShard(name="final_ln.weight", full_shape=(h,), partition_dim=None),
        ParamShard(name="final_ln.bias", full_shape=(h,), partition_dim=None),
        ParamShard(name="output.weight", full_shape=(v, h), partition_dim=0),
    ]
    return tuple(shards)


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _normal_init(seed: int, name: str, std: float) -> Callable[[torch.Tensor], None]:
    def init(tensor: torch.Tensor) -> None:
        generator = torch.Generator().manual_seed(_param_seed(seed, name))
        with torch.no_grad():
            tensor.normal_(0.0, std, generator=generator)

    return init


@dataclass(frozen=True, slots=True)
class _Layers:
    """Builds this model's Megatron layers over one TP group, initialised by name."""

    config: GPTConfig
    mp: ModelParallelConfig
    tp_group: dist.ProcessGroup

    def column(self, name: str, n_in: int, n_out: int, *, bias: bool = True) -> nn.Module:
        init = _normal_init(self.config.seed, name, self.config.init_std)
        layer: nn.Module = tensor_parallel.ColumnParallelLinear(
            n_in, n_out, config=self.mp, init_method=init, bias=bias,
            gather_output=False, tp_group=self.tp_group,
        )  # fmt: skip
        return layer

    def row(self, name: str, n_in: int, n_out: int) -> nn.Module:
        init = _normal_init(self.config.seed, name, self.config.init_std)
        layer: nn.Module = tensor_parallel.RowParallelLinear(
            n_in, n_out, config=self.mp, init_method=init, bias=True,
            input_is_parallel=True, skip_bias_add=False, tp_group=self.tp_group,
        )  # fmt: skip
        return layer


class _Block(nn.Module):
    def __init__(self, layers: _Layers, index: int) -> None:
        super().__init__()
        config, p = layers.config, f"layers.{index}."
        h, f = config.hidden_size, config.ffn_hidden_size
        self.num_local_heads = config.num_heads // layers.tp_group.size()
        self.head_dim = config.head_dim
        self.ln1 = nn.LayerNorm(h, eps=config.layernorm_eps)
        self.qkv = layers.column(p + "qkv", h, 3 * h)
        self.proj = layers.row(p + "proj", h, h)
        self.ln2 = nn.LayerNorm(h, eps=config.layernorm_eps)
        self.fc1 = layers.column(p + "fc1", h, f)
        self.fc2 = layers.row(p + "fc2", f, h)

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        qkv, _ = self.qkv(self.ln1(x))
        # Head-interleaved layout: per head, [q; k; v] rows, so a contiguous TP split of the
        # fused weight hands each rank whole heads.
        qkv = qkv.view(s, b, self.num_local_heads, 3, self.head_dim).permute(3, 1, 2, 0, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (b, heads, s, d)
        scores = torch.matmul(q * self.head_dim**-0.5, k.transpose(-1, -2))
        probs = torch.softmax(scores.masked_fill(causal_mask, float("-inf")), dim=-1)
        attn = torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, -1)
        out, _ = self.proj(attn)
        x = x + out
        hidden, _ = self.fc1(self.ln2(x))
        out, _ = self.fc2(F.gelu(hidden))
        result: torch.Tensor = x + out
        return result


class _GatherVocab(torch.autograd.Function):
    """All-gather vocabulary-parallel logits along the last dim; backward keeps this
    rank's slice. (Megatron's own gather uses the deprecated all_gather_into_tensor.)"""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.size = group.rank(), group.size()
        parts = [torch.empty_like(shard) for _ in range(ctx.size)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


class ParallelGPT(nn.Module):
    """The trainer's and the log-prob worker's model, tensor-parallel over ``tp_group``.

    Construction and forward are collective over ``tp_group`` (every TP rank calls them
    with the same inputs). Raises ValueError if the config does not split over the group.
    """

    def __init__(self, config: GPTConfig, *, tp_group: dist.ProcessGroup) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("ParallelGPT needs torch.distributed initialized (Megatron reads it)")
        tp = tp_group.size()
        config.check_tp(tp)
        if tp > 1:
            # Megatron warns unless this CUDA stream-ordering variable is set; on CPU it
            # orders nothing, so setting it only silences the warning.
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        self.config = config
        self.tp_group = tp_group
        mp = ModelParallelConfig(
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            perform_initialization=True,
            sequence_parallel=False,
            gradient_accumulation_fusion=False,
            deterministic_mode=True,
        )
        layers = _Layers(config, mp, tp_group)
        self.embedding = tensor_parallel.VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, config=mp, tp_group=tp_group,
            init_method=_normal_init(config.seed, "embedding", config.init_std),
        )  # fmt: skip
        self.position = nn.Embedding(config.max_seq_len, config.hidden_size)
        _normal_init(config.seed, "position", config.init_std)(self.position.weight)
        self.layers = nn.ModuleList(_Block(layers, i) for i in range(config.num_layers))
        self.final_ln = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        self.output = layers.column("output", config.hidden_size, config.vocab_size, bias=False)
        self._layout = {shard.name: shard for shard in param_layout(config)}
        assert list(self._layout) == [name for name, _ in self.named_parameters()]

    @property
    def tp_rank(self) -> int:
        """This process's rank in the tensor-parallel group."""
        return int(self.tp_group.rank())

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size."""
        return int(self.tp_group.size())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits, ``(batch, seq, vocab)``, of ``tokens`` ``(batch, seq)``.

        Causal: position t sees positions <= t, so right padding never changes earlier
        logits. Raises ValueError if the sequence is longer than ``max_seq_len``.
        """
        s = tokens.shape[1]
        if s > self.config.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.embedding(tokens.t().contiguous()) + self.position.weight[:s].unsqueeze(1)
        causal = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)
        for layer in self.layers:
            x = layer(x, causal)
        logits: torch.Tensor = self.output(self.final_ln(x))[0]
        if self.tp_size > 1:
            logits = _GatherVocab.apply(logits, self.tp_group)  # type: ignore[no-untyped-call]
        return logits.transpose(0, 1)

    def token_logprobs(self, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        """``out[i, t] = log p(tokens[i, t + 1] | tokens[i, : t + 1])``, shape ``(b, s - 1)``."""
        logits = self.forward(tokens)[:, :-1]
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor of parameter ``name``."""
        dim = self._layout[name].partition_dim
        if dim is None or self.tp_size == 1:
            return full
        return full.chunk(self.tp_size, dim=dim)[self.tp_rank]

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded copies of every parameter, in layout order.

        Collective over the TP group (an all-gather per sharded parameter); every TP rank
        gets the whole dict.
        """
        out: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():
            out[name] = self.gather_full(name, param.detach())
        return out

    def gather_full(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        """The unsharded tensor from every TP rank's ``shard`` of parameter ``name``
        (collective over the TP group when the parameter is sharded)."""
        dim = self._layout[name].partition_dim
        if dim is None or self.tp_size == 1:
            return shard.clone()
        parts = [torch.empty_like(shard) for _ in range(self.tp_size)]
        dist.all_gather(parts, shard.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slices of a full state dict into the parameters.

        Raises ValueError naming a missing, unexpected or wrongly shaped tensor (before
        any parameter is changed).
        """
        check_full_state(self.config, state)
        for name, param in self.named_parameters():
            param.copy_(self.shard_of(name, state[name]))


def check_full_state(config: GPTConfig, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``state`` has exactly the full tensors of ``config``."""
    layout = param_layout(config)
    expected = {shard.name for shard in layout}
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"state dict mismatch: missing {missing[:3]}, unexpected {extra[:3]}")
    for shard in layout:
        if tuple(state[shard.name].shape) != shard.full_shape:
            raise ValueError(
                f"{shard.name} has shape {tuple(state[shard.name].shape)}, "
                f"expected {shard.full_shape}"
            )


def local_world() -> None:
    """Give this process a one-rank default process group if it has none (idempotent).

    Megatron reads the default group; a runtime worker builds its real groups explicitly
    over the job's store and needs only this local stand-in (an in-memory store, no
    network). Runs on the worker's compute thread.
    """
    if not dist.is_initialized():
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


@contextlib.contextmanager
def solo_process_group() -> Iterator[dist.ProcessGroup]:
    """A one-rank gloo job for single-process use (tests, the smoke loop).

    Yields the world group and destroys it on exit. Raises ValueError if this process
    already belongs to a torch.distributed job.
    """
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialized in this process")
    with tempfile.TemporaryDirectory(prefix="dynarl-solo-") as tmp:
        path = os.path.join(tmp, "store")
        store = dist.FileStore(path, 1)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            group = dist.group.WORLD
            assert group is not None
            yield group
        finally:
            dist.destroy_process_group()
