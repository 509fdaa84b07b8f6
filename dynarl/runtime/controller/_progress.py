"""Progress: what one served item has produced so far, and how it continues.

An item (``GenerationRequest`` or ``Sample``) is served as one request at a time. A
result whose metadata says ``finish == "abort"`` is a partial output: its new tokens (and
log-probabilities) are kept and the next request is the *continuation* — the original
prompt plus everything generated so far, the remaining token budget, the original prompt
length in ``prompt_len`` so positions stay absolute. A partial that already used its
whole budget is final (a generation that was complete is never returned twice). The final
sample stitches everything together: original prompt, all generated tokens, all
log-probabilities, and how often it was resumed. Pure; runs in the dispatcher's loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from dynarl.bus import GenerationRequest, MetaValue, Sample, pack_tokens, unpack_tokens
from dynarl.migrate import PartialRequest
from dynarl.runtime._worker_protocol import FINISH, PROMPT_LEN, RESUMED, VERSIONS
from dynarl.sched import Affinity, RoutedItem

__all__ = ["Item", "Progress"]

Item = GenerationRequest | Sample
"""What a serving component takes."""


def _join(done: str, more: MetaValue) -> str:
    """Version runs of tokens so far followed by those of a newer output."""
    if not isinstance(more, str) or not more:
        return done
    return f"{done},{more}" if done else more


def _int(value: MetaValue) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


@dataclass(slots=True)
class Progress:
    """One item in a dispatcher, with what it produced so far."""

    original: Item
    """The item as submitted."""
    routed: RoutedItem = field(init=False)
    """Its routing context (episode, affinity, tool calls, cached prefix)."""
    generated: list[int] = field(default_factory=list)
    """Tokens generated so far, over every partial output."""
    logprobs: bytes = b""
    """Their log-probabilities, packed float32."""
    resumed: int = 0
    """Partial outputs absorbed so far."""
    versions: str = ""
    """Weight versions of the tokens generated so far (``VERSIONS`` text), when told."""
    failures: int = 0
    """Requests for it that failed (worker lost, deadline)."""

    def __post_init__(self) -> None:
        meta = self.original.metadata
        affinity = str(meta.get("affinity", "none"))
        item_id = self.original.sample_id
        self.routed = RoutedItem(
            item_id=item_id,
            episode=str(meta.get("episode", self.original.prompt_id or item_id)),
            affinity=Affinity(affinity) if affinity in set(Affinity) else Affinity.NONE,
            status=_int(meta.get("tool_calls")),
            cached_prefix=_int(meta.get("cached_prefix")),
            attained_service=float(_int(meta.get("attained_service"))),
            tool_ok=meta.get("tool_ok", True) is not False,
        )

    @property
    def item_id(self) -> str:
        """The item's id (its ``sample_id``)."""
        return self.original.sample_id

    def next_request(self) -> Item:
        """What to send next: the original, or its continuation after a partial output."""
        original = self.original
        if not isinstance(original, GenerationRequest) or not self.resumed:
            return original
        prompt = unpack_tokens(original.token_ids)
        meta = {**original.metadata, PROMPT_LEN: len(prompt), RESUMED: self.resumed}
        return GenerationRequest(
            sample_id=original.sample_id,
            token_ids=pack_tokens([*prompt.tolist(), *self.generated]),
            max_new_tokens=original.max_new_tokens - len(self.generated),
            prompt_id=original.prompt_id,
            temperature=original.temperature,
            top_p=original.top_p,
            seed=original.seed,
            priority=original.priority,
            metadata=meta,
        )

    def absorb(self, result: Sample) -> Sample | None:
        """Fold a worker's result in; the final sample, or None if the item continues."""
        if result.metadata.get(FINISH) != "abort":
            return self.final(result)
        original = self.original
        if not isinstance(original, GenerationRequest):
            return None  # nothing partial to keep: the original item runs again
        self.generated.extend(unpack_tokens(result.token_ids)[result.prompt_len :].tolist())
        self.logprobs += result.logprobs
        self.versions = _join(self.versions, result.metadata.get(VERSIONS))
        self.resumed += 1
        if len(self.generated) < original.max_new_tokens:
            return None
        final = self.final(None)
        meta = {**result.metadata, **final.metadata, FINISH: "length"}
        meta.pop(PROMPT_LEN, None)
        return msgspec.structs.replace(final, metadata=meta)

    def final(self, result: Sample | None) -> Sample:
        """The sample delivered for this item (``result``: the last request's, if any)."""
        original = self.original
        if not isinstance(original, GenerationRequest):
            return result if result is not None else original
        prompt = unpack_tokens(original.token_ids)
        generated, logprobs = list(self.generated), self.logprobs
        meta: dict[str, MetaValue] = dict(original.metadata)
        reward, version, versions = None, 0, self.versions
        if result is not None:
            generated += unpack_tokens(result.token_ids)[result.prompt_len :].tolist()
            logprobs += result.logprobs
            meta.update(result.metadata)
            reward, version = result.reward, result.policy_version
            versions = _join(versions, result.metadata.get(VERSIONS))
        meta.pop(PROMPT_LEN, None)
        meta[RESUMED] = self.resumed
        if versions:
            meta[VERSIONS] = versions
        return Sample(
            sample_id=original.sample_id,
            token_ids=pack_tokens([*prompt.tolist(), *generated]),
            prompt_len=len(prompt),
            prompt_id=original.prompt_id,
            reward=reward,
            logprobs=logprobs,
            policy_version=version,
            metadata=meta,
        )

    def failed(self, why: str) -> Sample:
        """The sample delivered for an item that failed for good (``finish == "error"``)."""
        sample = self.final(None)
        meta = {**sample.metadata, FINISH: "error", "error": why[:200]}
        return msgspec.structs.replace(sample, metadata=meta)

    def partial(self, worker: int) -> PartialRequest:
        """This item as the migrate planner's record of an aborted request on ``worker``."""
        prompt: tuple[int, ...] = ()
        if isinstance(self.original, GenerationRequest):
            prompt = tuple(int(t) for t in unpack_tokens(self.original.token_ids))
        return PartialRequest(
            request_id=self.item_id,
            prompt=prompt,
            generated=tuple(self.generated),
            priority=(float(self.routed.status), float(self.routed.cached_prefix)),
            affinity=str(self.routed.affinity),
            affinity_worker=worker,
        )

    def continue_elsewhere(self) -> None:
        """Its worker is gone: keep its context, drop what only that worker had."""
        routed = self.routed
        # A "must" affinity to a worker that left can only be a preference now.
        affinity = Affinity.PREFER if routed.affinity is Affinity.MUST else routed.affinity
        self.routed = RoutedItem(
            item_id=routed.item_id,
            episode=routed.episode,
            affinity=affinity,
            status=routed.status,
            cached_prefix=0,
            attained_service=float(_int(self.original.metadata.get("attained_service")))
            + len(self.generated),
            tool_ok=routed.tool_ok,
        )
