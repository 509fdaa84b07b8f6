"""The rollout engine's forward pass: rows of tokens against a KV pool, full weights.

The engine runs the model at tensor-parallel size 1 from a full state dict (as SGLang
runs its own kernels on weights Megatron trained), so this is a second implementation of
:class:`~._gpt.ParallelGPT`'s math, for inference: every token to compute is a *row*
(token, position, slot); prefill and decode rows of any number of sequences go through
one call. Tests check it against the trainer's model.

Deterministic mode makes each row's result a function of that row's sequence only —
independent of which other rows share the call, of how a prompt was split between the
prefix cache, prefill and decode, and of padding:

* linear layers run as a batch of 1-row products (``bmm`` of ``(1, in) @ (in, out)``
  per row against a stride-0 weight), never one ``(rows, in)`` GEMM, whose per-row
  results change with the number of rows (BLAS picks other kernels for the remainder
  rows; measured on this machine for 2–11 rows);
* attention spans a window of key rows fixed by the row's own position (the next power
  of two above it, 16 at least, ``max_seq_len`` at most), masking positions after the
  row's own with ``-inf`` (their weight is exactly 0), so a row's softmax and weighted
  sum always have the same length whatever the other rows are;
* LayerNorm, softmax and GELU are row-wise and elementwise.

The remaining assumption is one intra-op thread (a parallel split of an elementwise op
can move the vectorized-tail boundary into a row); the engine checks it. The fast mode
uses plain GEMMs and attends only as far as the longest sequence in the call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynarl.backends.reference._gpt import GPTConfig, check_full_state
from dynarl.backends.reference._kvcache import KVPool

__all__ = ["Decoder", "DecoderRows"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DecoderRows:
    """The rows of one forward call."""

    tokens: torch.Tensor
    """Token id of each row, ``(rows,)`` int64."""
    positions: torch.Tensor
    """Position of each row in its sequence, ``(rows,)`` int64."""
    slots: torch.Tensor
    """KV-pool slot of each row's sequence, ``(rows,)`` int64."""
    logit_rows: torch.Tensor
    """Indices of the rows whose next-token logits are wanted, ``(k,)`` int64."""


class _Linear:
    __slots__ = ("bias", "weight", "weight_t")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach().clone().contiguous()
        self.weight_t = self.weight.t().contiguous()
        self.bias = None if bias is None else bias.detach().clone()

    def __call__(self, x: torch.Tensor, row_invariant: bool) -> torch.Tensor:
        if not row_invariant:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        out = torch.bmm(x.unsqueeze(1), self.weight_t.expand(rows, *self.weight_t.shape))
        out = out.squeeze(1)
        return out if self.bias is None else out + self.bias


class Decoder:
    """Computes rows against a :class:`KVPool`; holds one full copy of the weights.

    Runs on the engine's compute thread. Raises ValueError from :meth:`load` on a state
    dict that does not match the config.
    """

    def __init__(self, config: GPTConfig, *, deterministic: bool) -> None:
        self.config = config
        self.deterministic = deterministic
        self._tensors: dict[str, torch.Tensor] = {}
        self._linears: dict[str, _Linear] = {}

    @property
    def loaded(self) -> bool:
        """Whether weights have been loaded."""
        return bool(self._tensors)

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take a copy of a full (unsharded) state dict of :class:`~._gpt.ParallelGPT`."""
        check_full_state(self.config, dict(state))
        tensors = {name: t.detach().clone().float() for name, t in state.items()}
        linears = {}
        for i in range(self.config.num_layers):
            for part in ("qkv", "proj", "fc1", "fc2"):
                name = f"layers.{i}.{part}"
                linears[name] = _Linear(tensors[name + ".weight"], tensors[name + ".bias"])
        linears["output"] = _Linear(tensors["output.weight"], None)
        self._tensors, self._linears = tensors, linears

    @torch.no_grad()
    def forward(self, pool: KVPool, rows: DecoderRows) -> torch.Tensor:
        """Write every row's keys and values into ``pool`` and return the logits of
        ``rows.logit_rows``, ``(k, vocab)``."""
        assert self.loaded, "Decoder.forward before load"
        cfg, t = self.config, self._tensors
        exact = self.deterministic
        groups = self._window_groups(rows.positions, pool.shape.max_seq_len)
        x = t["embedding.weight"][rows.tokens] + t["position.weight"][rows.positions]
        n = x.shape[0]
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            h = F.layer_norm(x, (cfg.hidden_size,), t[p + "ln1.weight"], t[p + "ln1.bias"])
            qkv = self._linears[p + "qkv"](h, exact).view(n, cfg.num_heads, 3, cfg.head_dim)
            pool.write(i, rows.slots, rows.positions, qkv[:, :, 1], qkv[:, :, 2])
            attn = torch.empty(n, cfg.hidden_size)
            for window, index in groups:
                attn[index] = self._attend(pool, i, qkv[index, :, 0], rows, index, window)
            x = x + self._linears[p + "proj"](attn, exact)
            h = F.layer_norm(x, (cfg.hidden_size,), t[p + "ln2.weight"], t[p + "ln2.bias"])
            h = F.gelu(self._linears[p + "fc1"](h, exact))
            x = x + self._linears[p + "fc2"](h, exact)
        x = x.index_select(0, rows.logit_rows)
        x = F.layer_norm(x, (cfg.hidden_size,), t["final_ln.weight"], t["final_ln.bias"])
        return self._linears["output"](x, exact)

    def _window_groups(
        self, positions: torch.Tensor, max_len: int
    ) -> list[tuple[int, torch.Tensor]]:
        """Rows grouped by the number of key rows their attention spans.

        Deterministic mode: a window that depends only on the row's own position (the
        next power of two above it, at least 16, at most ``max_len``), so a row is always
        computed with the same shapes. Fast mode: one window, the longest row's.
        """
        if not self.deterministic:
            return [(int(positions.max()) + 1, torch.arange(positions.shape[0]))]
        windows = (positions + 1).clamp(min=16).double().log2().ceil().exp2().long()
        windows = windows.clamp(max=max_len)
        return [(int(w), (windows == w).nonzero().squeeze(1)) for w in torch.unique(windows)]

    def _attend(
        self,
        pool: KVPool,
        layer: int,
        q: torch.Tensor,
        rows: DecoderRows,
        index: torch.Tensor,
        window: int,
    ) -> torch.Tensor:
        """Attention of query rows ``q`` ``(r, heads, d)`` over their slots' first
        ``window`` key rows, positions after each row's own masked with ``-inf``."""
        keys, values = pool.window(layer, rows.slots[index], window)
        masked = torch.arange(window).unsqueeze(0) > rows.positions[index].unsqueeze(1)
        scores = torch.matmul((q * self.config.head_dim**-0.5).unsqueeze(2), keys.transpose(-1, -2))
        probs = torch.softmax(scores.masked_fill(masked[:, None, None, :], float("-inf")), dim=-1)
        return torch.matmul(probs, values).reshape(q.shape[0], self.config.hidden_size)
