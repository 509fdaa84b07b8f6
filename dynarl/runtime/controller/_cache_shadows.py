"""The dispatcher's shadows of its engines' prefix caches: the cached-prefix term of the
request key (DynaRL's m_r), estimated, and checked against what the engines report.

One :class:`~dynarl.sched.PrefixShadow` per worker (``ComponentSpec.prefix_cache``, a
:class:`~dynarl.sched.PrefixCache`: block size and capacity, as the engine is configured).
A queued generation request's ``cached_prefix`` is what the shadow of its worker says its
prompt would find now. A request sent there is submitted to the shadow, which starts it
once its prompt's blocks fit (the engine's own waiting queue), taking its blocks and
caching its prompt (with ``PrefixCache.prefill_batch_s``, when its prefill batch ends:
requests sent within that many seconds of its first, on the monotonic clock, share one);
whenever one ends, what it computed is cached, its blocks are freed,
the requests that now fit start, and every request waiting on that worker is re-keyed.
The prediction of a request is the hit the shadow gives it when it starts there (until
then, and if the shadow never starts it before it ends, the hit when it was sent); it is
compared with the ``cached_tokens`` its engine reports (:class:`ShadowCheck`), so the
model's error is measured, not assumed. Runs on the dispatcher's loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dynarl.bus import GenerationRequest, Sample, unpack_tokens
from dynarl.runtime.controller._progress import Progress
from dynarl.sched import DataRouter, PrefixCache, PrefixShadow

__all__ = ["CacheShadows", "ShadowCheck"]

_CACHED = "cached_tokens"
"""Sample metadata key the serving roles report the engine's cached prompt tokens under."""


@dataclass(slots=True)
class ShadowCheck:
    """Predictions against the engines' reports."""

    predictions: int = 0
    """Requests whose engine reported its cached tokens."""
    exact: int = 0
    """Of those, predicted exactly."""
    abs_error_tokens: int = 0
    """Sum of |predicted - reported| tokens."""

    @property
    def exact_share(self) -> float:
        """Share predicted exactly (1.0 before any)."""
        return self.exact / self.predictions if self.predictions else 1.0


class CacheShadows:
    """Every worker's shadow (see the module docstring)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.check = ShadowCheck()
        self._shadows: dict[int, PrefixShadow] = {}
        self._predicted: dict[str, int] = {}

    def _shadow(self, worker: int) -> PrefixShadow:
        shadow = self._shadows.get(worker)
        if shadow is None:
            shadow = self._shadows[worker] = PrefixShadow(
                block_size=self.cache.block_size,
                capacity_blocks=self.cache.capacity_blocks,
                prefill_batch_s=self.cache.prefill_batch_s,
            )
        return shadow

    def rekey(self, router: DataRouter, worker: int, items: dict[str, Progress]) -> None:
        """Set the cached prefix of every request waiting on ``worker`` from its shadow."""
        shadow = self._shadow(worker)
        update = {}
        for queued in router.queued(worker):
            progress = items.get(queued.request_id)
            if progress is None or not isinstance(progress.original, GenerationRequest):
                continue
            hit = shadow.cached(_prompt(progress))
            if hit != queued.cached_prefix:
                update[queued.request_id] = hit
        if update:
            router.evict(worker, update)

    def dispatched(self, worker: int, progress: Progress) -> None:
        """A request goes out to ``worker``: submitted to its shadow; its prediction is
        the hit it has now, or the one it gets when the shadow starts it."""
        if not isinstance(progress.original, GenerationRequest):
            return
        prompt = _prompt(progress)
        shadow = self._shadow(worker)
        self._predicted[progress.item_id] = shadow.cached(prompt)
        # an attempt whose end the shadow never heard of (its send was cancelled) goes first
        now = time.monotonic()
        self._started(shadow.finish(progress.item_id, now=now))
        self._started(shadow.submit(progress.item_id, prompt, now=now))

    def ended(self, worker: int, progress: Progress, result: Sample | None) -> None:
        """A request on ``worker`` ended (``result``: its prompt and output; None: it
        failed): the shadow caches what it computed and frees its blocks; the prediction
        is checked."""
        shadow = self._shadow(worker)
        tokens = None if result is None else [int(t) for t in unpack_tokens(result.token_ids)]
        predicted = self._predicted.pop(progress.item_id, None)
        self._started(shadow.finish(progress.item_id, tokens, now=time.monotonic()))
        if result is None:
            return
        reported = result.metadata.get(_CACHED)
        if predicted is not None and isinstance(reported, int):
            self.check.predictions += 1
            self.check.exact += predicted == reported
            self.check.abs_error_tokens += abs(predicted - reported)

    def _started(self, hits: dict[str, int]) -> None:
        for item_id, hit in hits.items():
            if item_id in self._predicted:
                self._predicted[item_id] = hit

    def forget(self, worker: int) -> None:
        """``worker`` left: its shadow goes (a worker that comes back starts empty)."""
        self._shadows.pop(worker, None)


def _prompt(progress: Progress) -> list[int]:
    request = progress.next_request()
    assert isinstance(request, GenerationRequest)
    return [int(t) for t in unpack_tokens(request.token_ids)]
