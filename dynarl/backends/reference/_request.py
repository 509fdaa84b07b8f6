"""What travels to and from the rollout engine: requests, outputs and the queue protocol.

:class:`EngineStats` is what an engine reports about its load. A
:class:`GenerationRequest` is self-contained — prompt, limits, seed, and any tokens
already generated for it with their log-probs and weight versions — so a generation
aborted on one engine resumes on another from :meth:`GenerationOutput.resume_request`.
The engine's waiting room is any :class:`RequestQueue` (``push/pop/remove/len`` over
:class:`PendingRequest`); the scheduler's priority queue satisfies it, :class:`FifoQueue`
is the default. Pure data; no compute.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Protocol

__all__ = [
    "EngineStats",
    "FifoQueue",
    "FinishReason",
    "GenerationOutput",
    "GenerationRequest",
    "PendingRequest",
    "RequestQueue",
]


class FinishReason(enum.StrEnum):
    """Why a generation ended."""

    STOP = "stop"
    """A stop token was sampled (EOS, or a tool-call close in multi-turn tasks)."""
    LENGTH = "length"
    """``max_new_tokens`` or the engine's ``max_seq_len`` was reached."""
    ABORT = "abort"
    """Aborted; the output is partial and can be resumed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationRequest:
    """One generation: a prompt, limits, and any tokens already generated for it."""

    sample_id: int
    """Identifies the sample (one episode keeps its id across turns); keys sampling."""
    prompt: tuple[int, ...]
    """Prompt token ids (for a later turn: the whole episode so far)."""
    max_new_tokens: int
    """Most tokens to generate, counting ``resumed_tokens``."""
    seed: int = 0
    """Job seed; with ``sample_id`` and the position it keys each token's sampling."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    stop_tokens: tuple[int, ...] = ()
    """Token ids that end the generation (included in the output)."""
    num_tool_calls: int = 0
    """Tool calls the episode has completed (a priority key)."""
    resumed_tokens: tuple[int, ...] = ()
    """Tokens generated before an abort or retraction, continued from here."""
    resumed_logprobs: tuple[float, ...] = ()
    """Their log-probabilities."""
    resumed_versions: tuple[int, ...] = ()
    """The weight version each was sampled with."""

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("GenerationRequest.prompt must not be empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        n = len(self.resumed_tokens)
        if len(self.resumed_logprobs) != n or len(self.resumed_versions) != n:
            raise ValueError("resumed tokens, log-probs and versions must have equal lengths")
        if n >= self.max_new_tokens:
            raise ValueError("nothing left to generate: resumed_tokens >= max_new_tokens")

    @property
    def context(self) -> tuple[int, ...]:
        """Prompt followed by the resumed tokens: what the model conditions on."""
        return self.prompt + self.resumed_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationOutput:
    """A finished, aborted or retracted generation."""

    request: GenerationRequest
    """The request as submitted (its ``resumed_*`` included)."""
    tokens: tuple[int, ...]
    """Every generated token, resumed ones first."""
    logprobs: tuple[float, ...]
    """Log-probability of each generated token under the distribution it was sampled from."""
    versions: tuple[int, ...]
    """Weight version each generated token was sampled with."""
    finish_reason: FinishReason
    """Why it ended."""
    cached_tokens: int = 0
    """Prompt tokens served by the prefix cache at the last admission."""

    @property
    def sample_id(self) -> int:
        """The request's sample id."""
        return self.request.sample_id

    def resume_request(self) -> GenerationRequest:
        """A request that continues this (aborted) generation where it stopped.

        Raises ValueError if nothing is left to generate.
        """
        return replace(
            self.request,
            resumed_tokens=self.tokens,
            resumed_logprobs=self.logprobs,
            resumed_versions=self.versions,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PendingRequest:
    """A queued request with the facts a priority queue orders by."""

    request: GenerationRequest
    """The request."""
    cached_prefix_tokens: int
    """Tokens of its context the prefix cache held when it was queued."""
    arrival: int
    """Engine-local arrival counter (FIFO order, tie-breaks)."""

    @property
    def sample_id(self) -> int:
        """The request's sample id."""
        return self.request.sample_id

    @property
    def num_tool_calls(self) -> int:
        """Tool calls its episode has completed."""
        return self.request.num_tool_calls


class RequestQueue(Protocol):
    """The engine's waiting room; ``dynarl.sched``'s priority queue satisfies it.

    Defined here because backends cannot import the scheduler's types on this branch;
    the runtime injects the implementation.
    """

    def push(self, item: PendingRequest) -> None:
        """Add an item; raises ValueError if its sample id is already queued."""
        ...

    def pop(self) -> PendingRequest:
        """Remove and return the next item; raises IndexError when empty."""
        ...

    def remove(self, sample_id: int) -> PendingRequest | None:
        """Remove and return the item of ``sample_id``, or None if it is not queued."""
        ...

    def __len__(self) -> int: ...


class FifoQueue:
    """First in, first out :class:`RequestQueue` (the default)."""

    def __init__(self) -> None:
        self._items: OrderedDict[int, PendingRequest] = OrderedDict()

    def push(self, item: PendingRequest) -> None:
        """Append; raises ValueError on a duplicate sample id."""
        if item.sample_id in self._items:
            raise ValueError(f"sample {item.sample_id} is already queued")
        self._items[item.sample_id] = item

    def pop(self) -> PendingRequest:
        """The oldest item; raises IndexError when empty."""
        if not self._items:
            raise IndexError("pop from an empty queue")
        return self._items.popitem(last=False)[1]

    def remove(self, sample_id: int) -> PendingRequest | None:
        """Remove the item of ``sample_id`` if queued."""
        return self._items.pop(sample_id, None)

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineStats:
    """A snapshot of an engine's load and counters."""

    weight_version: int
    """Version of the loaded weights (-1: none)."""
    num_running: int
    """Sequences holding a slot."""
    num_queued: int
    """Requests waiting."""
    kv_tokens: int
    """KV tokens the running sequences hold."""
    utilization: float
    """``kv_tokens / kv_capacity_tokens``."""
    prefix_cache_tokens: int
    """Tokens held by the prefix cache."""
    prefix_hit_tokens: int
    """Prompt tokens served from the prefix cache so far."""
    prefill_tokens: int
    """Prompt tokens computed so far."""
    generated_tokens: int
    """Tokens sampled so far."""
    num_steps: int
    """Forward steps run so far."""
    num_retracted: int
    """Sequences retracted for KV capacity so far."""
