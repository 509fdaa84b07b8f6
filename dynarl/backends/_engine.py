"""What dynarl asks of a server-backed inference engine, whichever it is (vLLM, SGLang).

:class:`Engine` is the protocol the serving role (:mod:`dynarl.backends.serving`) drives;
``dynarl.backends.vllm.VLLMEngine`` and ``dynarl.backends.sglang.SGLangServerEngine``
implement it over each server's HTTP API. The types are dynarl's, and each adapter maps
them once, where the engines differ (measured in ``docs/engines.md``):

- **priority**: dynarl runs higher values first; vLLM runs *lower* values first and SGLang
  higher first (the adapter flips the sign where needed);
- **pause**: ``keep`` leaves running requests in place (vLLM ``keep``, SGLang
  ``in_place``), ``abort`` returns them partial; ``retract`` (SGLang only) puts them back
  in the queue with their KV freed, ``wait`` (vLLM only) lets them finish first. An
  adapter refuses a mode its engine lacks with ValueError (:attr:`Engine.pause_modes`);
- **weight versions**: every output token's version, as spans (both engines report them
  per request; a version is the string the last weight push set, dynarl's trainer step);
- **scoring**: the log-probability of every token of a given sequence after its first
  (:meth:`Engine.score`; vLLM ``prompt_logprobs``, SGLang ``input_token_logprobs``), what
  an inference component (a reference policy) computes.

Pure data and a protocol; runs anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "PAUSE_MODES",
    "Engine",
    "EngineLoad",
    "EngineOutput",
    "EngineRequest",
    "FinishReason",
    "PauseMode",
    "ScoreRequest",
    "VersionSpan",
    "check_scores",
    "spans_of",
    "versions_of",
]

PauseMode = Literal["keep", "abort", "retract", "wait"]
"""How a pause treats running requests (see the module docstring)."""
PAUSE_MODES: tuple[PauseMode, ...] = ("keep", "abort", "retract", "wait")
FinishReason = Literal["stop", "length", "abort"]
"""Why a generation ended; ``abort``: the output is partial."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineRequest:
    """One generation from token ids."""

    request_id: str
    """Unique among the engine's in-flight requests; :meth:`Engine.abort` takes it."""
    token_ids: tuple[int, ...]
    """The prompt (for a continuation: prompt and the partial output so far)."""
    max_new_tokens: int
    """Upper bound on generated tokens."""
    temperature: float = 1.0
    """Sampling temperature (0 is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    seed: int | None = None
    """Per-request sampling seed."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the generation (besides the model's end of sequence)."""
    ignore_eos: bool = False
    """Generate past the model's end-of-sequence token (fixed-length workloads)."""
    priority: int = 0
    """dynarl's priority: **higher runs first**."""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("EngineRequest.request_id must be a non-empty string")
        if not self.token_ids:
            raise ValueError(f"EngineRequest {self.request_id!r}: token_ids must not be empty")
        if min(self.token_ids) < 0:
            raise ValueError(f"EngineRequest {self.request_id!r}: token_ids must be >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"EngineRequest {self.request_id!r}: max_new_tokens must be >= 1, "
                f"got {self.max_new_tokens}"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"EngineRequest {self.request_id!r}: temperature must be >= 0 and top_p in "
                f"(0, 1], got {self.temperature} and {self.top_p}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoreRequest:
    """Score a sequence: the log-probability of each token after the first, given the
    tokens before it, under the weights in force (one prefill, nothing sampled)."""

    request_id: str
    """Unique among the engine's in-flight requests."""
    token_ids: tuple[int, ...]
    """The sequence (prompt and response), at least two tokens."""
    priority: int = 0
    """dynarl's priority: **higher runs first**."""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("ScoreRequest.request_id must be a non-empty string")
        if len(self.token_ids) < 2:
            raise ValueError(
                f"ScoreRequest {self.request_id!r}: scoring needs at least 2 tokens, got "
                f"{len(self.token_ids)}"
            )
        if min(self.token_ids) < 0:
            raise ValueError(f"ScoreRequest {self.request_id!r}: token_ids must be >= 0")


def check_scores(request: ScoreRequest, logprobs: Sequence[float]) -> tuple[float, ...]:
    """``logprobs`` as a tuple, ValueError unless there is one per token after the first
    (what every adapter's :meth:`Engine.score` returns)."""
    if len(logprobs) != len(request.token_ids) - 1:
        raise ValueError(
            f"score {request.request_id!r}: {len(logprobs)} log-probs for "
            f"{len(request.token_ids)} tokens (expected one per token after the first)"
        )
    return tuple(float(value) for value in logprobs)


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Output tokens ``[start, end)`` were sampled under weight version ``version``."""

    version: str
    start: int
    end: int


def spans_of(versions: Sequence[str]) -> tuple[VersionSpan, ...]:
    """Per-token versions as contiguous spans (``["3", "3", "4"]`` → two spans)."""
    spans: list[VersionSpan] = []
    for index, version in enumerate(versions):
        if spans and spans[-1].version == version:
            spans[-1] = VersionSpan(version, spans[-1].start, index + 1)
        else:
            spans.append(VersionSpan(version, index, index + 1))
    return tuple(spans)


def versions_of(spans: Sequence[VersionSpan], num_tokens: int) -> tuple[str, ...]:
    """The version of each of ``num_tokens`` output tokens; ValueError unless ``spans``
    cover ``[0, num_tokens)`` contiguously."""
    out: list[str] = []
    for span in spans:
        if span.start != len(out) or span.end <= span.start:
            raise ValueError(f"weight-version spans are not contiguous from 0: {list(spans)}")
        out += [span.version] * (span.end - span.start)
    if len(out) != num_tokens:
        raise ValueError(f"weight-version spans cover {len(out)} tokens, not {num_tokens}")
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineOutput:
    """A finished generation, or the partial output of an aborted one."""

    request_id: str
    token_ids: tuple[int, ...]
    """Generated token ids (not the prompt)."""
    logprobs: tuple[float, ...]
    """The log-probability of each generated token under the weights that sampled it."""
    finish: FinishReason
    versions: tuple[VersionSpan, ...]
    """Spans over the output giving each token's weight version."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the engine's prefix cache."""

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"request {self.request_id!r}: {len(self.logprobs)} log-probs for "
                f"{len(self.token_ids)} tokens"
            )
        versions_of(self.versions, len(self.token_ids))

    @property
    def aborted(self) -> bool:
        """Whether the output is partial."""
        return self.finish == "abort"

    def token_versions(self) -> tuple[str, ...]:
        """The weight version of each output token."""
        return versions_of(self.versions, len(self.token_ids))


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineLoad:
    """One reading of an engine's load; the counters count since it started."""

    running: int
    """Requests in the running batch."""
    waiting: int
    """Requests queued at the engine."""
    max_running: int
    """The most requests it runs at once (``max_num_seqs``, ``max_running_requests``)."""
    kv_usage: float
    """Fraction of the KV cache in use, in [0, 1]."""
    prefix_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_hit_tokens: int = 0
    """Of those, tokens found."""
    preemptions: int = 0
    """Requests preempted or retracted for KV space."""

    @property
    def utilization(self) -> float:
        """What the scheduler reads, in [0, 1]: the larger of KV use and running requests
        over the engine's limit. On CPU a tiny model's KV space holds hundreds of thousands
        of tokens, so KV use alone stays near zero however loaded the engine is."""
        slots = self.running / self.max_running if self.max_running > 0 else 0.0
        return min(1.0, max(self.kv_usage, slots))

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens found in the cache (0 before any lookup)."""
        queries = self.prefix_query_tokens
        return self.prefix_hit_tokens / queries if queries else 0.0


@runtime_checkable
class Engine(Protocol):
    """A server-backed inference engine as the serving role drives it (async, one loop).

    Errors: :class:`~dynarl.errors.BackendError` when the server fails or answers what
    the adapter cannot read, naming the engine; ValueError for a request or mode the
    engine cannot take.
    """

    name: str
    """For messages and logs (e.g. ``vllm@127.0.0.1:8000``)."""
    pause_modes: frozenset[PauseMode]
    """The pause modes this engine has."""

    @property
    def exit_cause(self) -> str | None:
        """How the engine's process ended on its own, if it did and the adapter can see it
        (``"killed by SIGKILL"``); None while it runs or when it cannot be watched."""
        ...

    async def start(self) -> None:
        """Launch the server (or attach to a running one) and wait until it is healthy."""
        ...

    async def aclose(self) -> None:
        """Stop what :meth:`start` launched (idempotent); a server attached to keeps running."""
        ...

    async def health(self) -> bool:
        """Whether the server answers its health check now."""
        ...

    async def generate(self, request: EngineRequest) -> EngineOutput:
        """Run one request to its end; after :meth:`abort`, its partial output."""
        ...

    async def score(self, request: ScoreRequest) -> tuple[float, ...]:
        """The log-probability of each token of ``request.token_ids`` after the first,
        given those before it (``len(token_ids) - 1`` values), under the weights in force."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort one request: its :meth:`generate` returns the partial output."""
        ...

    async def abort_all(self) -> None:
        """Abort every request in flight."""
        ...

    async def pause(self, mode: PauseMode) -> None:
        """Stop generating (see :data:`PauseMode`); requests sent meanwhile wait."""
        ...

    async def resume(self) -> None:
        """Generate again after :meth:`pause`."""
        ...

    async def load(self) -> EngineLoad:
        """The engine's load now."""
        ...

    async def set_weight_version(self, version: str) -> None:
        """Label the weights in force: tokens sampled from now on report ``version``."""
        ...

    async def weight_version(self) -> str:
        """The label in force (what the last :meth:`set_weight_version` or weight push set;
        the engine's own default before either)."""
        ...
