"""``SGLangServerEngine``: one SGLang server as the engine the serving role drives
(:class:`dynarl.backends._engine.Engine`).

It launches the server (:class:`SGLangServer`, one per device) or attaches to one already
running (``url``), and maps dynarl's requests, pause modes and load onto SGLang 0.5.23's
native API (measured in ``docs/engines.md``):

- **generate**: ``/generate`` from token ids with ``return_logprob``; the log-probs come
  from ``meta_info.output_token_logprobs``, the versions from ``meta_info.weight_versions``.
  **Scoring** is one greedy token with ``logprob_start_len=0``: the prompt's log-probs come
  from ``meta_info.input_token_logprobs`` (the first token's is null and is dropped).
  Priority is SGLang's own (higher first, as dynarl's) and is passed as it is; a launched
  server gets ``--enable-priority-scheduling``, an attached one needs it;
- **request ids**: SGLang aborts every in-flight request whose id *starts with* the one
  given, so the id sent is ``<length>:<request_id>``, which no other id starts with;
- **pause**: ``keep`` is SGLang's ``in_place``, ``abort`` and ``retract`` its own; there is
  no ``wait``. :meth:`~SGLangServerEngine.resume` is ``/continue_generation``;
- **weight versions**: ``/update_weight_version`` with ``abort_all_requests: false``
  (SGLang's default aborts everything in flight);
- **load**: ``/v1/loads`` summed over DP ranks (``token_usage`` is the KV use,
  ``max_running_requests`` the running limit). It has no cumulative prefix-cache or
  retraction counters (``cache_hit_rate`` is the last prefill batch's, ``queues.retracted``
  the last step's), so the counters of :class:`EngineLoad` add up what this adapter's
  finished requests reported: prompt and cached tokens, and retractions as preemptions.

A reply the adapter cannot read consistently (an unknown finish reason, log-probs or
version spans that do not match the output, another request's id) raises
:class:`~dynarl.errors.BackendError` naming the engine. Runs on the caller's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from dynarl.backends._engine import (
    EngineLoad,
    EngineOutput,
    EngineRequest,
    FinishReason,
    PauseMode,
    ScoreRequest,
    VersionSpan,
    check_scores,
    versions_of,
)
from dynarl.backends._server_engine import ServerEngine
from dynarl.backends.sglang._client import ClientConfig, SGLangClient
from dynarl.backends.sglang._http_wire import (
    GenerateRequest,
    GenerateResult,
    LoadsReply,
    SamplingParams,
)
from dynarl.backends.sglang._http_wire import PauseMode as SGLangPauseMode
from dynarl.backends.sglang._server_launcher import SGLangServer, SGLangServerConfig
from dynarl.errors import BackendError

__all__ = ["SGLangServerEngine", "wire_rid"]

logger = logging.getLogger(__name__)

_PAUSE: dict[PauseMode, SGLangPauseMode] = {
    "keep": "in_place",
    "abort": "abort",
    "retract": "retract",
}
_FINISH: frozenset[str] = frozenset({"stop", "length", "abort"})


def wire_rid(request_id: str) -> str:
    """The SGLang ``rid`` of ``request_id``: length-prefixed, so that SGLang's prefix-match
    abort reaches this request only (``"a"`` → ``"1:a"``, which ``"2:ab"`` does not start
    with)."""
    return f"{len(request_id)}:{request_id}"


class SGLangServerEngine(ServerEngine[SGLangServer, SGLangClient]):
    """One SGLang server: launched from ``server`` (stopped on :meth:`aclose`), or attached
    at ``url`` (left running). ``client`` sets the client's deadlines, retries and keys
    (default: a launched server's keys, SGLang's client defaults). An async context
    manager: :meth:`start` on entry, :meth:`aclose` on exit."""

    kind = "sglang"
    pause_modes: frozenset[PauseMode] = frozenset(_PAUSE)

    def __init__(
        self,
        *,
        server: SGLangServerConfig | None = None,
        url: str | None = None,
        client: ClientConfig | None = None,
    ) -> None:
        super().__init__(server=SGLangServer(server) if server is not None else None, url=url)
        self._client_config = client
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._retractions = 0

    def _open_client(self, url: str) -> SGLangClient:
        base = self._client_config
        if base is None and self._server is not None:
            base = self._server.client_config()
        return SGLangClient(replace(base or ClientConfig(base_url=url), base_url=url))

    async def generate(self, request: EngineRequest) -> EngineOutput:
        """Run ``request`` (an abort returns its partial output); BackendError naming the
        engine if the reply is not a consistent answer to it."""
        result = await self.client.generate(_sglang_request(request))
        output = self._output(request, result)
        self._prompt_tokens += output.prompt_tokens
        self._cached_tokens += output.cached_tokens
        self._retractions += result.num_retractions
        return output

    async def score(self, request: ScoreRequest) -> tuple[float, ...]:
        """Each token's log-prob after the first (``input_token_logprobs``); BackendError
        naming the engine if the reply does not give them for these tokens."""
        wire = GenerateRequest(
            rid=wire_rid(request.request_id),
            input_ids=list(request.token_ids),
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
            priority=request.priority,
            return_logprob=True,
            logprob_start_len=0,
        )
        result = await self.client.generate(wire)
        what = f"engine {self.name}: score {request.request_id!r}"
        if result.rid != wire.rid:
            raise BackendError(f"{what}: the reply is for rid {result.rid!r}")
        if result.aborted:
            raise BackendError(f"{what}: aborted ({result.finish_reason})")
        pairs = result.input_token_logprobs
        if pairs is None:
            raise BackendError(f"{what}: the reply has no input_token_logprobs")
        wrong = _mismatch([t for _, t in pairs], request.token_ids)
        if wrong:
            raise BackendError(
                f"{what}: input_token_logprobs are not for the tokens sent ({wrong})"
            )
        values = [logprob for logprob, _ in pairs[1:]]
        if any(value is None for value in values):
            raise BackendError(f"{what}: a prompt token after the first has a null log-prob")
        return check_scores(request, [value for value in values if value is not None])

    async def abort(self, request_id: str) -> None:
        """Abort one request by its id (a request not in flight is left alone)."""
        await self.client.abort(wire_rid(request_id))

    async def abort_all(self) -> None:
        """Abort every request the server holds."""
        await self.client.abort_all()

    async def pause(self, mode: PauseMode) -> None:
        """``/pause_generation`` in SGLang's mode for ``mode``; ValueError for ``wait``
        (SGLang has none)."""
        if mode not in _PAUSE:
            raise ValueError(
                f"engine {self.name}: SGLang has no pause mode {mode!r}; it has "
                f"{sorted(self.pause_modes)}"
            )
        await self.client.pause(_PAUSE[mode])
        logger.info("engine %s paused (%s)", self.name, mode)

    async def resume(self) -> None:
        """``/continue_generation``."""
        await self.client.continue_generation()
        logger.info("engine %s resumed", self.name)

    async def load(self) -> EngineLoad:
        """``/v1/loads`` summed over DP ranks, with this adapter's counters (see the module
        docstring); BackendError if it lists no rank."""
        return self._load(await self.client.loads(include="core"))

    async def set_weight_version(self, version: str) -> None:
        """``/update_weight_version`` without aborting anything; BackendError if refused."""
        result = await self.client.update_weight_version(version, abort_all_requests=False)
        if not result.success:
            raise BackendError(
                f"engine {self.name}: /update_weight_version {version!r} refused: {result.message}"
            )

    async def weight_version(self) -> str:
        """``/model_info``'s ``weight_version``: the label in force."""
        return str((await self.client.model_info()).get("weight_version", ""))

    # ------------------------------------------------------------------ mapping

    def _load(self, loads: LoadsReply) -> EngineLoad:
        ranks = loads.loads
        if not ranks:
            raise BackendError(f"engine {self.name}: /v1/loads lists no DP rank")
        capacity = sum(rank.max_total_num_tokens for rank in ranks)
        if capacity > 0:
            usage = sum(rank.token_usage * rank.max_total_num_tokens for rank in ranks) / capacity
        else:
            usage = sum(rank.token_usage for rank in ranks) / len(ranks)
        return EngineLoad(
            running=sum(rank.num_running_reqs for rank in ranks),
            waiting=sum(rank.num_waiting_reqs for rank in ranks),
            max_running=sum(rank.max_running_requests for rank in ranks),
            kv_usage=min(1.0, max(0.0, usage)),
            prefix_query_tokens=self._prompt_tokens,
            prefix_hit_tokens=self._cached_tokens,
            preemptions=self._retractions,
        )

    def _output(self, request: EngineRequest, result: GenerateResult) -> EngineOutput:
        what = f"engine {self.name}: request {request.request_id!r}"
        if result.rid != wire_rid(request.request_id):
            raise BackendError(f"{what}: the reply is for rid {result.rid!r}")
        reason = result.finish_reason
        finish = reason.type if reason is not None else None
        if finish not in _FINISH:
            raise BackendError(f"{what}: unknown finish reason {finish!r}")
        tokens = result.output_ids
        try:
            return EngineOutput(
                request_id=request.request_id,
                token_ids=tokens,
                logprobs=_logprobs(result, tokens),
                finish=cast(FinishReason, finish),
                versions=_spans(result, len(tokens)),
                prompt_tokens=result.prompt_tokens,
                cached_tokens=result.cached_tokens,
            )
        except ValueError as exc:
            raise BackendError(f"{what}: inconsistent reply: {exc}") from exc


def _sglang_request(request: EngineRequest) -> GenerateRequest:
    return GenerateRequest(
        rid=wire_rid(request.request_id),
        input_ids=list(request.token_ids),
        sampling_params=SamplingParams(
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stop_token_ids=list(request.stop_token_ids) or None,
            ignore_eos=request.ignore_eos,
            sampling_seed=request.seed,
        ),
        priority=request.priority,
        return_logprob=True,
    )


def _logprobs(result: GenerateResult, tokens: tuple[int, ...]) -> tuple[float, ...]:
    """``output_token_logprobs`` checked against the output; ValueError if they differ."""
    pairs = result.output_token_logprobs
    if pairs is None:
        raise ValueError("no meta_info.output_token_logprobs (return_logprob was sent)")
    if tuple(token for _, token in pairs) != tokens:
        raise ValueError(f"output_token_logprobs are for other tokens than output_ids {tokens}")
    logprobs: list[float] = []
    for index, (logprob, _) in enumerate(pairs):
        if logprob is None:
            raise ValueError(f"output token {index} has a null log-probability")
        logprobs.append(logprob)
    return tuple(logprobs)


def _spans(result: GenerateResult, num_tokens: int) -> tuple[VersionSpan, ...]:
    """``weight_versions`` without SGLang's empty span of an empty output; ValueError unless
    they cover the output."""
    if result.weight_versions is None:
        if num_tokens:
            raise ValueError("no meta_info.weight_versions on a final reply")
        return ()
    spans = tuple(
        VersionSpan(span.version, span.start, span.end)
        for span in result.weight_versions
        if span.end > span.start
    )
    versions_of(spans, num_tokens)
    return spans


def _mismatch(got: Sequence[int], sent: Sequence[int]) -> str:
    """Where the token ids of a reply's ``input_token_logprobs`` part from those sent, in
    words ("" where they agree). SGLang 0.5.23 reports the model's last token id
    (``vocab_size - 1``, often EOS) as 0 there — it clips image-hash padding with
    ``x < vocab_size - 1`` — while the log-prob is the sent token's (measured: the value
    differs from token 0's); so a 0 may stand for the largest id sent."""
    if len(got) != len(sent):
        return f"{len(got)} tokens for {len(sent)} sent"
    largest = max(sent, default=0)
    for at, (a, b) in enumerate(zip(got, sent, strict=True)):
        if a != b and not (a == 0 and b == largest):
            return f"token {at} of {len(sent)} is {a}, {b} was sent"
    return ""
