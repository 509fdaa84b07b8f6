"""What dynarl sends to and reads from a vLLM 0.32 server (dev mode, ``--enable-scale-out``).

Generation goes through ``POST /inference/v1/generate``: token ids in, token ids out, the
log-prob of each sampled token, and the weight version of each output token as spans. The
differences from dynarl's conventions are translated here, once:

- **priority**: dynarl runs higher priorities first, vLLM lower values first;
  :func:`vllm_priority` negates, and only :func:`request_body` calls it;
- **request ids**: vLLM prefixes the caller's id (``generate-tokens-<id>``) and aborts by
  the prefixed id; :func:`engine_request_id` adds the prefix and :func:`decode_generate_reply`
  takes it off again.

Scoring a sequence (an inference component's log-probs) is one generate call for one token
with ``prompt_logprobs=0``: vLLM answers the log-prob of every prompt token after the first
(:func:`score_body`, :func:`decode_score_reply`).

Replies are checked for consistency (one choice, a log-prob for each token id, version
spans that cover the output): a reply that is not raises ``ValueError`` or
``msgspec.ValidationError``. Load figures come from the Prometheus text of ``/metrics``
(:func:`parse_metrics`). Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "ENGINE_REQUEST_PREFIX",
    "GenerateRequest",
    "GenerateResult",
    "PauseMode",
    "SamplingParams",
    "VLLMLoad",
    "WeightVersionSpan",
    "decode_generate_reply",
    "decode_score_reply",
    "engine_request_id",
    "parse_metrics",
    "request_body",
    "score_body",
    "vllm_priority",
]

PauseMode = Literal["abort", "wait", "keep"]
"""``POST /pause?mode=``: abort in-flight requests (their callers get partial outputs), wait
for them to finish, or freeze them with their KV until ``/resume``."""

ENGINE_REQUEST_PREFIX = "generate-tokens-"
"""What vLLM puts before the caller's request id on ``/inference/v1/generate``."""

_INT64_MAX = 2**63 - 1


def vllm_priority(priority: int) -> int:
    """dynarl's priority (higher runs first) as vLLM's (lower runs first): its negation.

    Raises ValueError outside the range whose negation fits vLLM's signed 64 bits.
    """
    if not -_INT64_MAX <= priority <= _INT64_MAX:
        raise ValueError(f"priority must be within ±(2**63 - 1), got {priority}")
    return -priority


def engine_request_id(request_id: str) -> str:
    """The id vLLM gives the request the caller sent as ``request_id`` (what abort takes)."""
    return ENGINE_REQUEST_PREFIX + request_id


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling parameters dynarl sets, with vLLM's defaults.

    All of them go on the wire: vLLM fills a key left out from the model's generation
    config, not from these defaults.
    """

    max_tokens: int
    """Upper bound on generated tokens."""
    min_tokens: int = 0
    """Tokens generated before a stop condition may end the request."""
    temperature: float = 1.0
    """Sampling temperature (0 is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k cut-off (0: none)."""
    seed: int | None = None
    """Per-request sampling seed."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the request."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One generation from token ids, in dynarl's terms."""

    request_id: str
    """The caller's id: unique among in-flight requests; abort takes it."""
    token_ids: list[int]
    """Prompt token ids."""
    sampling_params: SamplingParams
    """Sampling parameters."""
    priority: int = 0
    """dynarl's priority: **higher runs first** (vLLM's sign is flipped on the wire)."""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("GenerateRequest.request_id must be a non-empty string")
        if not self.token_ids:
            raise ValueError("GenerateRequest.token_ids must not be empty")
        if min(self.token_ids) < 0:
            raise ValueError("GenerateRequest.token_ids must not be negative")
        vllm_priority(self.priority)


def request_body(request: GenerateRequest) -> dict[str, Any]:
    """The ``/inference/v1/generate`` JSON body of ``request`` (not streamed; the log-prob
    of each sampled token asked for)."""
    sampling = msgspec.to_builtins(request.sampling_params) | {"logprobs": 0}
    return {
        "request_id": request.request_id,
        "token_ids": list(request.token_ids),
        "sampling_params": sampling,
        "priority": vllm_priority(request.priority),
        "stream": False,
    }


def score_body(request_id: str, token_ids: list[int], priority: int = 0) -> dict[str, Any]:
    """The ``/inference/v1/generate`` JSON body that scores ``token_ids``: one greedy token
    (discarded) and each prompt token's log-prob (``prompt_logprobs=0``: the token's own,
    no alternatives)."""
    if not request_id:
        raise ValueError("a score request needs a non-empty request_id")
    if len(token_ids) < 2 or min(token_ids) < 0:
        raise ValueError(f"score {request_id!r}: needs >= 2 token ids, none negative")
    sampling = msgspec.to_builtins(SamplingParams(max_tokens=1, temperature=0.0))
    return {
        "request_id": request_id,
        "token_ids": list(token_ids),
        "sampling_params": sampling | {"prompt_logprobs": 0},
        "priority": vllm_priority(priority),
        "stream": False,
    }


class _PromptLogProb(msgspec.Struct, frozen=True):
    logprob: float


class _ScoreReply(msgspec.Struct, frozen=True):
    request_id: str
    prompt_logprobs: list[dict[int, _PromptLogProb] | None] | None = None


def decode_score_reply(body: bytes, request_id: str, token_ids: list[int]) -> tuple[float, ...]:
    """The log-prob of each of ``token_ids`` after the first, from a reply to
    :func:`score_body`.

    Raises ``msgspec.ValidationError`` if ``body`` is not such a reply, ValueError if it is
    one but for another request, or its prompt log-probs do not match ``token_ids``.
    """
    reply = msgspec.json.decode(body, type=_ScoreReply)
    if reply.request_id != engine_request_id(request_id):
        raise ValueError(f"reply for {reply.request_id!r}, expected {request_id!r}")
    entries = reply.prompt_logprobs
    if entries is None or len(entries) != len(token_ids):
        count = "none" if entries is None else len(entries)
        raise ValueError(f"{count} prompt log-probs for {len(token_ids)} prompt tokens")
    out: list[float] = []
    for position, (token, entry) in enumerate(zip(token_ids[1:], entries[1:], strict=True)):
        if entry is None or token not in entry:
            raise ValueError(f"no log-prob for prompt token {token} at position {position + 1}")
        out.append(entry[token].logprob)
    return tuple(out)


class WeightVersionSpan(msgspec.Struct, frozen=True, kw_only=True):
    """Output tokens ``[start, end)`` were sampled under weight version ``version``."""

    version: str
    start: int
    end: int


class GenerateResult(msgspec.Struct, frozen=True, kw_only=True):
    """A finished (or aborted) generation."""

    request_id: str
    """The caller's id."""
    token_ids: tuple[int, ...]
    """Generated token ids (the partial output when aborted)."""
    logprobs: tuple[float, ...]
    """The log-prob of each generated token, as sampled."""
    finish_reason: str
    """``"length"``, ``"stop"`` or ``"abort"``."""
    weight_versions: tuple[WeightVersionSpan, ...]
    """Contiguous spans over the output that give each token's weight version."""
    stop_reason: int | str | None = None
    """The stop token id or string that ended it, if one did."""
    prompt_tokens: int = 0
    """Prompt length in tokens."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (whole blocks)."""

    @property
    def aborted(self) -> bool:
        """Whether the request was aborted (the output is partial)."""
        return self.finish_reason == "abort"

    def token_versions(self) -> tuple[str, ...]:
        """The weight version of each output token."""
        return tuple(s.version for s in self.weight_versions for _ in range(s.start, s.end))


class _LogProb(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float


class _LogProbs(msgspec.Struct, frozen=True):
    content: list[_LogProb] | None = None


class _Choice(msgspec.Struct, frozen=True):
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    logprobs: _LogProbs | None = None


class _PromptDetails(msgspec.Struct, frozen=True):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None


class _Reply(msgspec.Struct, frozen=True):
    request_id: str
    choices: list[_Choice]
    usage: _Usage | None = None


def decode_generate_reply(body: bytes, request_id: str) -> GenerateResult:
    """The :class:`GenerateResult` of ``request_id`` in a non-streamed generate reply.

    Raises ``msgspec.ValidationError`` if ``body`` is not a generate reply, ValueError if
    it is one but inconsistent (another request, not one choice, unfinished, log-probs or
    version spans that do not match the token ids).
    """
    reply = msgspec.json.decode(body, type=_Reply)
    if reply.request_id != engine_request_id(request_id):
        raise ValueError(f"reply for {reply.request_id!r}, expected {request_id!r}")
    if len(reply.choices) != 1:
        raise ValueError(f"expected one choice, got {len(reply.choices)}")
    choice = reply.choices[0]
    if choice.finish_reason is None:
        raise ValueError("reply has no finish_reason")
    token_ids = tuple(choice.token_ids or ())
    entries = (choice.logprobs.content if choice.logprobs else None) or []
    if [entry.token_id for entry in entries] != list(token_ids):
        raise ValueError(f"{len(entries)} log-probs do not match {len(token_ids)} token ids")
    spans = tuple(choice.weight_versions or ())
    _check_spans(spans, len(token_ids))
    usage = reply.usage or _Usage()
    details = usage.prompt_tokens_details
    return GenerateResult(
        request_id=request_id,
        token_ids=token_ids,
        logprobs=tuple(entry.logprob for entry in entries),
        finish_reason=choice.finish_reason,
        weight_versions=spans,
        stop_reason=choice.stop_reason,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=(details.cached_tokens or 0) if details else 0,
    )


def _check_spans(spans: tuple[WeightVersionSpan, ...], num_tokens: int) -> None:
    """Spans must tile ``[0, num_tokens)`` in order (none at all for no tokens)."""
    position = 0
    for span in spans:
        if span.start != position or span.end <= span.start:
            raise ValueError(f"weight-version spans {spans} do not tile the output")
        position = span.end
    if position != num_tokens:
        raise ValueError(f"weight-version spans cover {position} of {num_tokens} tokens")


class VLLMLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One ``/metrics`` reading of a vLLM server, summed over its engines (data-parallel
    ranks); counters count since the server started."""

    num_running: int
    """Requests in the running batch (``vllm:num_requests_running``)."""
    num_waiting: int
    """Requests waiting to be scheduled (``vllm:num_requests_waiting``)."""
    kv_cache_usage: float
    """Fraction of KV-cache blocks in use, the largest over engines
    (``vllm:kv_cache_usage_perc``; 1.0 is full)."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache (``vllm:prefix_cache_queries_total``)."""
    prefix_cache_hits: int
    """Of those, tokens found (``vllm:prefix_cache_hits_total``)."""
    num_preemptions: int
    """Requests preempted for KV space (``vllm:num_preemptions_total``)."""
    generation_tokens: int
    """Tokens generated (``vllm:generation_tokens_total``)."""


_SUMMED = {
    "num_running": "vllm:num_requests_running",
    "num_waiting": "vllm:num_requests_waiting",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "num_preemptions": "vllm:num_preemptions_total",
    "generation_tokens": "vllm:generation_tokens_total",
}
_KV_USAGE = "vllm:kv_cache_usage_perc"


def parse_metrics(text: str) -> VLLMLoad:
    """The :class:`VLLMLoad` in a ``/metrics`` reply (Prometheus text format).

    Raises ValueError if a metric it needs is missing or one of its sample lines is
    malformed. Lines of other metrics are skipped by name, unparsed: a server's reply has
    hundreds of them, and the role reads it several times a second.
    """
    wanted = {*_SUMMED.values(), _KV_USAGE}
    samples: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or _name(line) not in wanted:
            continue
        name, value = _sample(line)
        samples.setdefault(name, []).append(value)
    missing = sorted(wanted - samples.keys())
    if missing:
        raise ValueError(f"/metrics lacks {missing}")
    summed = {field: int(sum(samples[name])) for field, name in _SUMMED.items()}
    return VLLMLoad(kv_cache_usage=max(samples[_KV_USAGE]), **summed)


def _name(line: str) -> str:
    """The metric name a sample line starts with (before its labels or value)."""
    end = len(line)
    for stop in ("{", " "):
        found = line.find(stop)
        if found != -1:
            end = min(end, found)
    return line[:end]


def _sample(line: str) -> tuple[str, float]:
    """``name{labels} value [timestamp]`` → (name, value); label values may hold any
    character, escaped quotes included."""
    brace = line.find("{")
    space = line.find(" ")
    if brace == -1 or (space != -1 and space < brace):
        name, _, rest = line.partition(" ")
    else:
        name, rest = line[:brace], line[_labels_end(line, brace) + 1 :]
    fields = rest.split()
    if not name or not fields:
        raise ValueError(f"malformed metrics line {line!r}")
    try:
        return name, float(fields[0])
    except ValueError as exc:
        raise ValueError(f"malformed metrics value in {line!r}") from exc


def _labels_end(line: str, start: int) -> int:
    """The index of the ``}`` that closes the label set opened at ``start``."""
    quoted = escaped = False
    for index in range(start + 1, len(line)):
        char = line[index]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "}" and not quoted:
            return index
    raise ValueError(f"unclosed label set in metrics line {line!r}")
