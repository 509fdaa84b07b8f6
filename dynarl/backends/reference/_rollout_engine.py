"""The reference rollout engine: continuous batching over a per-sequence KV cache.

One :meth:`RolloutEngine.step` admits queued requests while slots, KV capacity and the
per-step prefill budget allow (copying any cached prefix into the new slot), runs one
forward over the uncomputed tokens of every running sequence — prompt tails of new ones,
the last sampled token of the others — samples one token per sequence, and returns the
sequences that finished. A sequence stops on one of its stop tokens, at
``max_new_tokens`` or at ``max_seq_len``. When running sequences outgrow the KV capacity
the newest are retracted: their KV goes to the prefix cache and they are queued again as
continuations, which — sampling being keyed by position — generate what they would have.

The queue is injected: anything with ``push/pop/remove/len`` over :class:`PendingRequest`
(:class:`RequestQueue`); the scheduler's priority queue plugs in here, and
:class:`FifoQueue` is the default. Each queued item says how many tool calls its episode
has completed and how much of its prompt the prefix cache holds, the two priority keys.

Every generated token records its log-probability and the weight version it was sampled
with; :meth:`RolloutEngine.abort` returns a partial output from which
:meth:`GenerationOutput.resume_request` continues elsewhere, so a sequence aborted across
a weight sync mixes versions honestly. Synchronous and single-threaded: the worker that
owns the engine calls it from its one compute thread.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from dynarl.backends.reference._decoder import Decoder, DecoderRows
from dynarl.backends.reference._gpt import GPTConfig
from dynarl.backends.reference._kvcache import KVPool, KVPoolShape
from dynarl.backends.reference._prefix_cache import PrefixCache
from dynarl.backends.reference._request import (
    EngineStats,
    FifoQueue,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    PendingRequest,
    RequestQueue,
)
from dynarl.backends.reference._sampling import sample_tokens, sampling_uniform
from dynarl.errors import BackendError

__all__ = ["EngineConfig", "RolloutEngine"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """Capacity and mode of a :class:`RolloutEngine`."""

    num_slots: int = 32
    """Most sequences decoded together (the batch size)."""
    max_seq_len: int = 256
    """Longest sequence, prompt included; at most the model's ``max_seq_len``."""
    kv_capacity_tokens: int = 4096
    """KV tokens the running sequences may hold together (utilization's denominator)."""
    prefix_cache_tokens: int = 4096
    """Token capacity of the prefix cache (0 disables it)."""
    max_step_tokens: int = 512
    """Prefill tokens admitted per step (a single larger prompt is still admitted alone)."""
    deterministic: bool = False
    """Batch-invariant decoding (see :mod:`._decoder`); needs one intra-op thread."""

    def __post_init__(self) -> None:
        for name in ("num_slots", "max_seq_len", "max_step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_capacity_tokens < self.max_seq_len:
            raise ValueError("EngineConfig.kv_capacity_tokens must be >= max_seq_len")
        if self.prefix_cache_tokens < 0:
            raise ValueError("EngineConfig.prefix_cache_tokens must be >= 0")


class _Running:
    __slots__ = ("cached", "computed", "fresh", "logprobs", "request", "slot", "tokens", "versions")

    def __init__(self, request: GenerationRequest, slot: int, cached: int) -> None:
        self.request, self.slot, self.cached = request, slot, cached
        self.fresh = True
        self.tokens = list(request.context)
        self.computed = cached
        self.logprobs = list(request.resumed_logprobs)
        self.versions = list(request.resumed_versions)

    @property
    def generated(self) -> tuple[int, ...]:
        return tuple(self.tokens[len(self.request.prompt) :])


class RolloutEngine:
    """Batched generation over one full copy of the policy weights.

    Raises ValueError at construction on a config the model cannot serve, or in
    deterministic mode when torch uses more than one intra-op thread.
    """

    def __init__(
        self, model: GPTConfig, config: EngineConfig, *, queue: RequestQueue | None = None
    ) -> None:
        if config.max_seq_len > model.max_seq_len:
            raise ValueError("EngineConfig.max_seq_len exceeds the model's max_seq_len")
        if config.deterministic and torch.get_num_threads() != 1:
            raise ValueError("deterministic decoding needs torch.set_num_threads(1)")
        self.model_config = model
        self.config = config
        self.decoder = Decoder(model, deterministic=config.deterministic)
        self.pool = KVPool(
            KVPoolShape(
                num_layers=model.num_layers,
                num_slots=config.num_slots,
                num_heads=model.num_heads,
                head_dim=model.head_dim,
                max_seq_len=config.max_seq_len,
            )
        )
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens)
        self.queue: RequestQueue = queue if queue is not None else FifoQueue()
        self.weight_version = -1
        self._held: PendingRequest | None = None
        self._running: dict[int, _Running] = {}
        self._queued: set[int] = set()
        self._arrivals = 0
        self._prefill_tokens = self._generated_tokens = self._steps = self._retracted = 0

    # ------------------------------------------------------------------ control
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Install a full state dict as weight version ``version``.

        The prefix cache is cleared and running sequences are re-queued as continuations
        (their KV was computed with the old weights); their next tokens carry the new
        version. Raises ValueError on a mismatching state dict or a version older than
        the current one.
        """
        if version < self.weight_version:
            raise ValueError(f"weight version {version} is older than {self.weight_version}")
        self.decoder.load(state)
        self.prefix_cache.clear()
        for sample_id in list(self._running):
            self._retract(sample_id, cache_kv=False)
        logger.info("engine weights -> version %d", version)
        self.weight_version = version

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request. Raises ValueError if its sample id is already in the engine or
        its context leaves no room under ``max_seq_len``."""
        if len(request.context) >= self.config.max_seq_len:
            raise ValueError(
                f"sample {request.sample_id}: context of {len(request.context)} tokens leaves "
                f"no room under max_seq_len={self.config.max_seq_len}"
            )
        if self._knows(request.sample_id):
            raise ValueError(f"sample {request.sample_id} is already in the engine")
        self._push(request)

    def abort(self, sample_id: int) -> GenerationOutput | None:
        """Stop one sample wherever it is; its partial output, or None if unknown."""
        held = self._held
        if held is not None and held.sample_id == sample_id:
            self._held = None
            return _unstarted_output(held)
        queued = self.queue.remove(sample_id)
        if queued is not None:
            self._queued.discard(sample_id)
            return _unstarted_output(queued)
        if sample_id in self._running:
            return self._finish(sample_id, FinishReason.ABORT)
        return None

    def abort_all(self) -> list[GenerationOutput]:
        """Abort everything running, held or queued; their partial outputs."""
        outputs = [self._finish(sid, FinishReason.ABORT) for sid in list(self._running)]
        if self._held is not None:
            outputs.append(_unstarted_output(self._held))
            self._held = None
        while len(self.queue):
            outputs.append(_unstarted_output(self.queue.pop()))
        self._queued.clear()
        return outputs

    # ------------------------------------------------------------------ running
    @property
    def has_work(self) -> bool:
        """Whether anything is running or waiting."""
        return bool(self._running) or self._held is not None or len(self.queue) > 0

    @property
    def kv_tokens(self) -> int:
        """KV tokens held by running sequences (computed or computed this step)."""
        return sum(len(seq.tokens) for seq in self._running.values())

    @property
    def utilization(self) -> float:
        """Active KV tokens / KV capacity, in [0, 1]."""
        return min(1.0, self.kv_tokens / self.config.kv_capacity_tokens)

    def step(self) -> list[GenerationOutput]:
        """Admit, run one forward over every running sequence, sample; the finished ones.

        Raises BackendError if there is work but no weights, or if deterministic mode
        finds more than one intra-op thread.
        """
        if not self.has_work:
            return []
        if not self.decoder.loaded:
            raise BackendError("RolloutEngine.step before load_weights")
        if self.config.deterministic and torch.get_num_threads() != 1:
            raise BackendError("deterministic decoding needs torch.set_num_threads(1)")
        self._admit()
        if not self._running:
            return []
        seqs = list(self._running.values())
        logits = self.decoder.forward(self.pool, self._rows(seqs))
        self._steps += 1
        outputs = self._sample(seqs, logits)
        self._retract_over_capacity()
        return outputs

    def run_until_idle(self, *, max_steps: int = 100_000) -> list[GenerationOutput]:
        """Step until nothing is left; every output. Raises BackendError after
        ``max_steps`` steps with work remaining."""
        outputs: list[GenerationOutput] = []
        for _ in range(max_steps):
            if not self.has_work:
                return outputs
            outputs.extend(self.step())
        if self.has_work:
            raise BackendError(f"engine still busy after {max_steps} steps")
        return outputs

    def stats(self) -> EngineStats:
        """Current load and counters."""
        return EngineStats(
            weight_version=self.weight_version,
            num_running=len(self._running),
            num_queued=len(self.queue) + (self._held is not None),
            kv_tokens=self.kv_tokens,
            utilization=self.utilization,
            prefix_cache_tokens=self.prefix_cache.num_tokens,
            prefix_hit_tokens=self.prefix_cache.hit_tokens,
            prefill_tokens=self._prefill_tokens,
            generated_tokens=self._generated_tokens,
            num_steps=self._steps,
            num_retracted=self._retracted,
        )

    # ------------------------------------------------------------------ internals
    def _knows(self, sample_id: int) -> bool:
        held = self._held is not None and self._held.sample_id == sample_id
        return held or sample_id in self._running or sample_id in self._queued

    def _push(self, request: GenerationRequest) -> None:
        cached = self.prefix_cache.peek_length(request.context)
        self._arrivals += 1
        self._queued.add(request.sample_id)
        self.queue.push(
            PendingRequest(request=request, cached_prefix_tokens=cached, arrival=self._arrivals)
        )

    def _admit(self) -> None:
        budget, admitted = self.config.max_step_tokens, 0
        while self.pool.num_free:
            if self._held is None:
                if not len(self.queue):
                    return
                self._held = self.queue.pop()
                self._queued.discard(self._held.sample_id)
            request = self._held.request
            context = request.context
            if self._running and self.kv_tokens + len(context) + 1 > self.config.kv_capacity_tokens:
                return
            match = self.prefix_cache.match(context)
            reuse = 0 if match is None else min(match.length, len(context) - 1)
            if admitted and len(context) - reuse > budget:
                return
            slot = self.pool.allocate()
            if match is not None and reuse:
                self.pool.load_prefix(slot, match.keys[:, :, :reuse], match.values[:, :, :reuse])
            self._running[request.sample_id] = _Running(request, slot, reuse)
            self._held = None
            budget -= len(context) - reuse
            admitted += 1

    def _rows(self, seqs: list[_Running]) -> DecoderRows:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        for seq in seqs:
            n = len(seq.tokens) - seq.computed
            tokens += seq.tokens[seq.computed :]
            positions += range(seq.computed, len(seq.tokens))
            slots += [seq.slot] * n
            last.append(len(tokens) - 1)
            if seq.fresh:
                self._prefill_tokens += n
                seq.fresh = False
        return DecoderRows(
            tokens=torch.tensor(tokens),
            positions=torch.tensor(positions),
            slots=torch.tensor(slots),
            logit_rows=torch.tensor(last),
        )

    def _sample(self, seqs: list[_Running], logits: torch.Tensor) -> list[GenerationOutput]:
        temps = [seq.request.temperature for seq in seqs]
        uniforms = [
            sampling_uniform(seq.request.seed, seq.request.sample_id, len(seq.tokens))
            for seq in seqs
        ]
        tokens, logprobs = sample_tokens(logits, temps, uniforms)
        outputs = []
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True):
            seq.computed = len(seq.tokens)
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.weight_version)
            self._generated_tokens += 1
            reason = self._finish_reason(seq, token)
            if reason is not None:
                outputs.append(self._finish(seq.request.sample_id, reason))
        return outputs

    def _finish_reason(self, seq: _Running, token: int) -> FinishReason | None:
        if token in seq.request.stop_tokens:
            return FinishReason.STOP
        generated = len(seq.tokens) - len(seq.request.prompt)
        if generated >= seq.request.max_new_tokens or len(seq.tokens) >= self.config.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _release(self, seq: _Running, *, cache_kv: bool) -> None:
        if cache_kv and seq.computed:
            keys, values = self.pool.read_prefix(seq.slot, seq.computed)
            self.prefix_cache.insert(seq.tokens[: seq.computed], keys, values)
        self.pool.release(seq.slot)

    def _finish(self, sample_id: int, reason: FinishReason) -> GenerationOutput:
        seq = self._running.pop(sample_id)
        self._release(seq, cache_kv=True)
        return GenerationOutput(
            request=seq.request,
            tokens=seq.generated,
            logprobs=tuple(seq.logprobs),
            versions=tuple(seq.versions),
            finish_reason=reason,
            cached_tokens=seq.cached,
        )

    def _retract(self, sample_id: int, *, cache_kv: bool) -> None:
        seq = self._running.pop(sample_id)
        self._release(seq, cache_kv=cache_kv)
        self._retracted += 1
        self._push(
            replace(
                seq.request,
                resumed_tokens=seq.generated,
                resumed_logprobs=tuple(seq.logprobs),
                resumed_versions=tuple(seq.versions),
            )
        )

    def _retract_over_capacity(self) -> None:
        # Next step every running sequence grows by one token.
        while len(self._running) > 1 and (
            self.kv_tokens + len(self._running) > self.config.kv_capacity_tokens
        ):
            newest = next(reversed(self._running))
            logger.debug("retracting sample %d: KV capacity", newest)
            self._retract(newest, cache_kv=True)


def _unstarted_output(item: PendingRequest) -> GenerationOutput:
    request = item.request
    return GenerationOutput(
        request=request,
        tokens=request.resumed_tokens,
        logprobs=request.resumed_logprobs,
        versions=request.resumed_versions,
        finish_reason=FinishReason.ABORT,
    )
