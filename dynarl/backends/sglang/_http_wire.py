"""The JSON bodies dynarl sends to and reads from SGLang 0.5.23's native HTTP API.

Request types carry only fields SGLang accepts, with SGLang's own defaults (a contract test
checks them against the pinned wheel's ``io_struct.py`` and ``api/v1/api_types.py``), and
omit defaults on the wire. Reply types read what SGLang returns and ignore keys they do not
know, so a newer server does not break an older client. Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "MEMORY_TAGS",
    "ChecksumReply",
    "ControlResult",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "LoadSnapshot",
    "LoadsReply",
    "MemoryMetrics",
    "PauseMode",
    "QueueMetrics",
    "RankChecksum",
    "SamplingParams",
    "WeightVersionSpan",
    "decode_generate_result",
]

PauseMode = Literal["abort", "retract", "in_place"]
"""``/pause_generation`` modes: abort in-flight requests, move running requests back to the
waiting queue (their KV is freed and recomputed later), or freeze them with their KV."""

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""The tags ``/release_memory_occupation`` and ``/resume_memory_occupation`` accept."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The sampling parameters dynarl sets; a subset of SGLang's, with SGLang's defaults.

    SGLang refuses unknown keys here (HTTP 400 ``unknown field``), so only these are sent.
    """

    max_new_tokens: int = 128
    """Upper bound on generated tokens."""
    min_new_tokens: int = 0
    """Tokens generated before a stop condition may end the request."""
    temperature: float = 1.0
    """Sampling temperature (0 is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 1073741824
    """Top-k cut-off (SGLang's default means "no cut-off")."""
    stop: str | list[str] | None = None
    """Stop strings."""
    stop_token_ids: list[int] | None = None
    """Stop token ids."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    sampling_seed: int | None = None
    """Per-request sampling seed (deterministic sampling)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One ``/generate`` request (``GenerateReqInput``): a single prompt, never a batch."""

    rid: str
    """Request id: used to abort it and to match its result; unique among in-flight ones."""
    input_ids: list[int] | None = None
    """Prompt token ids (exactly one of ``input_ids`` and ``text``)."""
    text: str | None = None
    """Prompt text (exactly one of ``input_ids`` and ``text``)."""
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    """Sampling parameters."""
    priority: int | None = None
    """Scheduling priority (server started with ``--enable-priority-scheduling``; higher
    first unless ``--schedule-low-priority-values-first``)."""
    session_id: str | None = None
    """Stable identity shared by the turns of one episode (does not change the prompt)."""
    return_logprob: bool | None = None
    """Return each output token's log-probability (``meta_info.output_token_logprobs``)."""
    logprob_start_len: int | None = None
    """With ``return_logprob``: also the prompt's log-probs from this token on
    (``meta_info.input_token_logprobs``; the first entry's is null). The prefix cache is
    matched no further than here, so 0 recomputes the whole prompt."""

    def __post_init__(self) -> None:
        if not self.rid:
            raise ValueError("GenerateRequest.rid must be a non-empty string")
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("GenerateRequest needs exactly one of input_ids and text")


class FinishReason(msgspec.Struct, frozen=True, kw_only=True):
    """``meta_info.finish_reason``: why a request ended."""

    type: str
    """``"stop"``, ``"length"`` or ``"abort"``."""
    message: str | None = None
    """Abort message (``"Aborted"`` for a running request, ``"Abort in waiting queue"``)."""
    matched: int | str | None = None
    """The stop token id or string that matched (``"stop"``)."""
    length: int | None = None
    """The length limit that was reached (``"length"``)."""
    status_code: int | None = None
    """HTTP status an abort carries, if any."""


class WeightVersionSpan(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of ``meta_info.weight_versions``: output tokens ``[start, end)`` were
    sampled under ``version``. SGLang sends them on a request's final reply only; an empty
    output has one empty span (``start == end == 0``)."""

    version: str
    start: int
    end: int


class _MetaInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    e2e_latency: float | None = None
    weight_version: str | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    num_retractions: int = 0
    output_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None


class _GenerateReply(msgspec.Struct, frozen=True, kw_only=True):
    text: str | None = None
    output_ids: list[int] = msgspec.field(default_factory=list)
    meta_info: _MetaInfo = msgspec.field(default_factory=_MetaInfo)


class GenerateResult(msgspec.Struct, frozen=True, kw_only=True):
    """A ``/generate`` reply (or one cumulative streaming chunk), flattened."""

    rid: str
    """The request id."""
    text: str
    """Generated text so far."""
    output_ids: tuple[int, ...]
    """Generated token ids so far (the partial output when aborted)."""
    finish_reason: FinishReason | None
    """Why it ended; None for a streaming chunk that is not the last."""
    prompt_tokens: int = 0
    """Prompt length in tokens (0 when SGLang aborted it before tokenizing it)."""
    completion_tokens: int = 0
    """Generated tokens."""
    cached_tokens: int = 0
    """Prompt tokens served from the radix (prefix) cache: the reusable prefix."""
    e2e_latency: float | None = None
    """Seconds from arrival to completion, as the server measured it."""
    weight_version: str | None = None
    """Weight version that produced the output."""
    num_retractions: int = 0
    """Times the request was retracted (preempted) and recomputed."""
    weight_versions: tuple[WeightVersionSpan, ...] | None = None
    """Spans over the output giving each token's weight version (final replies only)."""
    output_token_logprobs: tuple[tuple[float | None, int], ...] | None = None
    """``(log-probability, token id)`` of each output token, when ``return_logprob`` was
    set (SGLang sends ``[logprob, token_id, text]``; the text is dropped)."""
    input_token_logprobs: tuple[tuple[float | None, int], ...] | None = None
    """``(log-probability, token id)`` of each prompt token from ``logprob_start_len`` on
    (the first one's log-probability is None)."""

    @property
    def finished(self) -> bool:
        """Whether this is a final result."""
        return self.finish_reason is not None

    @property
    def aborted(self) -> bool:
        """Whether the request was aborted (the output is partial)."""
        return self.finish_reason is not None and self.finish_reason.type == "abort"


def decode_generate_result(body: bytes | dict[str, Any], rid: str) -> GenerateResult:
    """Flatten one ``/generate`` JSON object into a :class:`GenerateResult`.

    Raises ``msgspec.ValidationError`` if the body is not a generate reply.
    """
    if isinstance(body, bytes):
        reply = msgspec.json.decode(body, type=_GenerateReply)
    else:
        reply = msgspec.convert(body, type=_GenerateReply)
    meta = reply.meta_info
    return GenerateResult(
        rid=meta.id or rid,
        text=reply.text or "",
        output_ids=tuple(reply.output_ids),
        finish_reason=meta.finish_reason,
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=meta.completion_tokens or len(reply.output_ids),
        cached_tokens=meta.cached_tokens,
        e2e_latency=meta.e2e_latency,
        weight_version=meta.weight_version,
        num_retractions=meta.num_retractions,
        weight_versions=tuple(meta.weight_versions) if meta.weight_versions is not None else None,
        output_token_logprobs=_pairs(meta.output_token_logprobs),
        input_token_logprobs=_pairs(meta.input_token_logprobs),
    )


def _pairs(
    entries: list[tuple[float | None, int, str | None]] | None,
) -> tuple[tuple[float | None, int], ...] | None:
    """SGLang's ``[logprob, token_id, text]`` entries without their text."""
    if entries is None:
        return None
    return tuple((logprob, token) for logprob, token, _ in entries)


class ControlResult(msgspec.Struct, frozen=True, kw_only=True):
    """The ``{"success", "message"}`` reply of SGLang's weight-update endpoints."""

    success: bool
    """Whether the server did it."""
    message: str = ""
    """The server's message (the reason, on failure)."""


class MemoryMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """``LoadSnapshot.memory``: memory breakdown of one DP rank."""

    weight_gb: float
    kv_cache_gb: float
    graph_gb: float
    token_capacity: int


class QueueMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """``LoadSnapshot.queues``: queue breakdown of one DP rank."""

    waiting: int
    grammar: int
    paused: int
    retracted: int
    prealloc_ready: int


class LoadSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One DP rank's entry of ``/v1/loads`` (``managers/load_snapshot.py``)."""

    timestamp: float = 0.0
    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_uncached_tokens: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    num_active_tokens: int = 0
    num_prealloc_ready_tokens: int = 0
    max_total_num_tokens: int = 0
    max_running_requests: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    utilization: float = 0.0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0
    decode_moments: list[float] | None = None
    memory: MemoryMetrics | None = None
    queues: QueueMetrics | None = None


class LoadsReply(msgspec.Struct, frozen=True, kw_only=True):
    """The ``/v1/loads`` reply: one :class:`LoadSnapshot` per DP rank."""

    timestamp: str = ""
    version: str = ""
    accelerator: str | None = None
    num_accelerators: int = 0
    loads: list[LoadSnapshot] = msgspec.field(default_factory=list)

    @property
    def idle(self) -> bool:
        """Whether no DP rank has a running or waiting request."""
        return all(load.num_running_reqs == 0 and load.num_waiting_reqs == 0 for load in self.loads)


class RankChecksum(msgspec.Struct, frozen=True, kw_only=True):
    """One TP rank's entry of ``/weights_checker`` (``ChecksumInfo``)."""

    checksums: dict[str, str]
    """Per-parameter hashes under SGLang's internal parameter names."""
    per_gpu_checksum: str
    """SHA-256 over the sorted (name, hash) pairs."""
    parallelism_info: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """Placement per role (target, drafts)."""


class ChecksumReply(msgspec.Struct, frozen=True, kw_only=True):
    """The ``/weights_checker`` reply for ``action="checksum"``."""

    success: bool
    message: str = ""
    ranks: list[RankChecksum] = msgspec.field(default_factory=list)
    per_engine_checksum: str | None = None
