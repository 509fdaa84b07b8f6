"""A shadow of one engine's KV block pool and prefix cache: what a request will find cached
when the engine starts it.

DynaRL's request key orders by the reusable cached prefix (m_r); an engine does not say
what it holds before a request runs, so the dispatcher keeps a model of each engine's
cache and asks it. :class:`PrefixShadow` follows vLLM's block pool rule by rule (at one
token a block, an approximation of SGLang's radix cache, whose admission and eviction
differ in detail):

* **blocks**: KV lives in ``capacity_blocks`` blocks of ``block_size`` tokens (vLLM: its
  ``num_gpu_blocks`` less the null block it keeps back; 16 tokens on GPU, 128 on its CPU
  backend). A *full* block is cached under its tokens and every token before it (a hash
  chain, as vLLM hashes blocks), so two sequences share cached blocks exactly as far as
  their prefixes agree in whole blocks; a partial block is never cached;
* **a hit**: the longest chain of cached blocks of a prompt, never its last token (the
  engine computes that one for its logits: vLLM caps a hit at ``len - 1`` rounded down to
  a block);
* **blocks are shared and counted**: a running request holds its hit blocks (with every
  other request that hit them) and blocks of its own for the rest of its tokens; a block
  is free once no request holds it, and a free cached block still serves hits;
* **when blocks are cached**: a request's full prompt blocks as it starts (a sibling
  started after it hits them); when it ends, the full blocks of all its tokens but the
  last (the engine never computed that token's KV). Two requests that computed the same
  block separately hold two copies (vLLM does not de-duplicate), and the block stays
  cached while either copy does;
* **eviction**: a new block is taken from the free blocks, never-cached ones first, then
  cached ones least recently freed first, which evicts that copy; an ending request frees
  its blocks tail first (its partial block to be reused at once, its prefix to outlive
  its extensions); a hit on a free cached block takes it back from the free list;
* **admission**: requests start in the order they were sent, each once the blocks its
  prompt needs beyond its hit are free (vLLM's waiting queue: one that does not fit holds
  back those behind it); its hit is what the cache holds at that moment.
* **prefill batches** (``prefill_batch_s`` set; SGLang, measured): a started request's
  prompt is cached only when its prefill batch ends — requests sent within
  ``prefill_batch_s`` of the batch's first are in it, and each computes its own copy of a
  prompt they share; the batch has ended once a later request is sent after the window or
  one of it ends. Unset (vLLM) a prompt is cached as its request starts.

Not modelled: a request's output blocks are taken when it ends, not step by step, so
decode growth and the preemptions it causes are invisible until then. A model, checked
against each request's reported ``cached_tokens`` by whoever runs it. Pure data
structure; not thread-safe.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefixCache", "PrefixShadow"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefixCache:
    """How an engine's prefix cache is laid out, for its shadow."""

    block_size: int
    """Tokens per cached block (vLLM: 16 on GPU, 128 on CPU; SGLang: 1)."""
    capacity_blocks: int
    """Blocks the engine can fill with KV: vLLM's ``num_gpu_blocks``
    (``--num-gpu-blocks-override``) less the null block it keeps back; SGLang
    ``--max-total-tokens`` over the block size."""
    prefill_batch_s: float | None = None
    """None: a prompt is cached as its request starts (vLLM hashes a request's blocks when
    it is scheduled). A number of seconds: the engine caches prompts only when the prefill
    batch that computed them ends (SGLang's radix tree), and requests sent within this
    long of the first of a batch are taken to share its prefill batch (about one engine
    step)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.capacity_blocks < 1:
            raise ValueError(
                f"PrefixCache needs block_size >= 1 and capacity_blocks >= 1, got "
                f"{self.block_size} and {self.capacity_blocks}"
            )
        if self.prefill_batch_s is not None and not self.prefill_batch_s >= 0:
            raise ValueError(
                f"PrefixCache.prefill_batch_s must be None or >= 0 seconds, got "
                f"{self.prefill_batch_s}"
            )


@dataclass(slots=True)
class _Running:
    """A started request's blocks, in token order."""

    blocks: list[int]
    num_cached: int
    """Leading blocks already cached (its hit, then what it computed)."""


class PrefixShadow:
    """One engine's block pool and prefix cache, modelled (see the module docstring).
    Raises ValueError for a block size or capacity below 1 or a negative batch window."""

    def __init__(
        self, *, block_size: int, capacity_blocks: int, prefill_batch_s: float | None = None
    ) -> None:
        PrefixCache(
            block_size=block_size, capacity_blocks=capacity_blocks, prefill_batch_s=prefill_batch_s
        )  # checks the values
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.prefill_batch_s = prefill_batch_s
        self._batch: dict[str, list[int]] = {}
        """Started requests (and their prompts) whose prefill batch has not ended."""
        self._batch_start = 0.0
        self._blank: deque[int] = deque(range(capacity_blocks))
        """Free blocks that cache nothing, the next to be taken first."""
        self._lru: OrderedDict[int, None] = OrderedDict()
        """Free cached blocks, least recently freed first."""
        self._chain_of: dict[int, bytes] = {}
        """Cached blocks and their chain ids."""
        self._copies: dict[bytes, dict[int, None]] = {}
        """Each cached chain id's blocks, the first cached first."""
        self._refs: dict[int, int] = {}
        """Held blocks and how many running requests hold each."""
        self._running: dict[str, _Running] = {}
        self._waiting: OrderedDict[str, list[int]] = OrderedDict()

    def __len__(self) -> int:
        """Blocks that hold a cached prefix (copies counted)."""
        return len(self._chain_of)

    @property
    def free_blocks(self) -> int:
        """Blocks no running request holds."""
        return len(self._blank) + len(self._lru)

    @property
    def waiting(self) -> tuple[str, ...]:
        """Requests sent and not started yet (no room for their prompt), in order."""
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[str, ...]:
        """Requests started and not ended."""
        return tuple(self._running)

    def cached(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens``' longest cached prefix (whole blocks; never the last
        token). Changes nothing."""
        return len(self._hit(tokens)) * self.block_size

    def submit(self, request_id: str, tokens: Sequence[int], *, now: float = 0.0) -> dict[str, int]:
        """Request ``request_id`` with prompt ``tokens`` was sent to the engine at ``now``
        (seconds on any clock; used only with ``prefill_batch_s``): it waits behind those
        sent before it. Returns the requests that start now (it, or none) with the tokens
        each finds cached. ValueError for an id that is waiting or running."""
        if request_id in self._waiting or request_id in self._running:
            raise ValueError(f"request {request_id!r} was already submitted")
        self._settle(now)
        self._waiting[request_id] = [int(t) for t in tokens]
        return self._admit(now)

    def finish(
        self, request_id: str, tokens: Sequence[int] | None = None, *, now: float = 0.0
    ) -> dict[str, int]:
        """Request ``request_id`` ended at ``now``, ``tokens`` its prompt and output (None:
        it failed, nothing more was computed): what it computed is cached, its blocks are
        freed tail first. An ending request's prefill batch has ended. Returns the
        requests that start now, with the tokens each finds cached. Idempotent for an
        unknown request."""
        self._waiting.pop(request_id, None)
        run = self._running.pop(request_id, None)
        if run is None:
            return {}
        if request_id in self._batch:
            self._settle(None)
        if tokens is not None:
            computed = [int(t) for t in tokens][: max(0, len(tokens) - 1)]
            self._grow(run, len(computed))
            self._cache(run, computed)
        fresh = []
        for block in reversed(run.blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                if block in self._chain_of:
                    self._lru[block] = None
                else:
                    fresh.append(block)
        self._blank.extendleft(reversed(fresh))
        return self._admit(now)

    def clear(self) -> None:
        """The engine's prefix cache was reset: nothing is cached (blocks stay held)."""
        self._batch.clear()
        self._blank.extend(self._lru)
        self._lru.clear()
        self._chain_of.clear()
        self._copies.clear()

    def _settle(self, now: float | None) -> None:
        """The prefill batch in flight has ended (``now`` past its window, or None: it
        surely has): cache its prompts."""
        if not self._batch:
            return
        assert self.prefill_batch_s is not None
        if now is not None and now - self._batch_start <= self.prefill_batch_s:
            return
        batch, self._batch = self._batch, {}
        for request_id, tokens in batch.items():
            run = self._running.get(request_id)
            if run is not None:  # one that ended cached what it computed then
                self._cache(run, tokens)

    def _admit(self, now: float = 0.0) -> dict[str, int]:
        started: dict[str, int] = {}
        while self._waiting:
            request_id, tokens = next(iter(self._waiting.items()))
            hit = self._start(request_id, tokens, now)
            if hit is None:
                break
            del self._waiting[request_id]
            started[request_id] = hit
        return started

    def _start(self, request_id: str, tokens: list[int], now: float) -> int | None:
        """Start a request if its prompt fits; its hit in tokens, or None."""
        hit = self._hit(tokens)
        reclaimed = sum(1 for block in hit if block not in self._refs)
        if self._num_blocks(len(tokens)) - len(hit) + reclaimed > self.free_blocks:
            return None
        for block in hit:
            if block not in self._refs:
                del self._lru[block]
            self._refs[block] = self._refs.get(block, 0) + 1
        run = _Running(blocks=list(hit), num_cached=len(hit))
        self._running[request_id] = run
        self._grow(run, len(tokens))
        if self.prefill_batch_s is None:
            self._cache(run, tokens)
        else:  # cached when its prefill batch ends
            if not self._batch:
                self._batch_start = now
            self._batch[request_id] = tokens
        return len(hit) * self.block_size

    def _hit(self, tokens: Sequence[int]) -> list[int]:
        blocks = []
        for chain_id in self._chain(tokens[: max(0, len(tokens) - 1)]):
            copies = self._copies.get(chain_id)
            if not copies:
                break
            blocks.append(next(iter(copies)))
        return blocks

    def _grow(self, run: _Running, num_tokens: int) -> None:
        """Blocks for ``num_tokens`` tokens, as many as are free."""
        while len(run.blocks) < self._num_blocks(num_tokens) and self.free_blocks:
            block = self._blank.popleft() if self._blank else self._evict()
            self._refs[block] = 1
            run.blocks.append(block)

    def _evict(self) -> int:
        block, _ = self._lru.popitem(last=False)
        chain_id = self._chain_of.pop(block)
        copies = self._copies[chain_id]
        del copies[block]
        if not copies:
            del self._copies[chain_id]
        return block

    def _cache(self, run: _Running, tokens: Sequence[int]) -> None:
        """Cache ``run``'s blocks that ``tokens`` fill."""
        chain = self._chain(tokens)
        end = min(len(chain), len(run.blocks))
        for index in range(run.num_cached, end):
            block = run.blocks[index]
            self._chain_of[block] = chain[index]
            self._copies.setdefault(chain[index], {})[block] = None
        run.num_cached = max(run.num_cached, end)

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _chain(self, tokens: Sequence[int]) -> list[bytes]:
        """The ids of ``tokens``' whole blocks, each hashing its predecessor's id."""
        out: list[bytes] = []
        parent = b""
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = tokens[start : start + size]
            digest = hashlib.blake2b(parent, digest_size=16)
            digest.update(b",".join(str(int(t)).encode() for t in block))
            parent = digest.digest()
            out.append(parent)
        return out
