"""An async HTTP client for one vLLM 0.32 server started in dev mode with
``--enable-scale-out`` (see :mod:`._launcher`).

Every call has a deadline and goes through :mod:`dynarl.backends._http`: a call that never
reached the server is retried; one that broke, timed out or got 502/503/504 is retried only
on the idempotent endpoints — ``/health``, ``/metrics``, ``/is_paused``, ``/weight_info``,
``/abort_requests``, ``/pause``, ``/resume``, ``/reset_prefix_cache`` and
``/update_weight_version`` (setting a label twice is setting it once). Generation is never
retried past a connection: it would run twice.

Aborting does not return the partial output: the caller still waiting in
:meth:`VLLMClient.generate` gets it, as a result whose ``finish_reason`` is ``"abort"``.
An abort reaches only requests the server has received. HTTP errors and unreadable or
inconsistent replies raise :class:`~dynarl.errors.BackendError`. Runs on the caller's event
loop; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from dynarl.backends._http import HttpClient, HttpClientConfig, decode_reply
from dynarl.backends.vllm._wire import (
    GenerateRequest,
    GenerateResult,
    PauseMode,
    VLLMLoad,
    decode_generate_reply,
    decode_score_reply,
    engine_request_id,
    parse_metrics,
    request_body,
    score_body,
)
from dynarl.errors import BackendError

__all__ = ["VLLMClient", "VLLMClientConfig"]

_PAUSE_MODES = ("abort", "wait", "keep")


class _Aborted(msgspec.Struct, frozen=True):
    aborted: int = 0


class _Paused(msgspec.Struct, frozen=True):
    is_paused: bool


class _Success(msgspec.Struct, frozen=True):
    success: bool


class _RpcResults(msgspec.Struct, frozen=True):
    results: list[Any]


class _WeightInfo(msgspec.Struct, frozen=True):
    weight_version: str


@dataclass(frozen=True, kw_only=True, slots=True)
class VLLMClientConfig(HttpClientConfig):
    """How a :class:`VLLMClient` reaches its server (the keys of
    :class:`~dynarl.backends._http.HttpClientConfig`; ``generate_timeout_s`` also bounds a
    pause that waits for requests to finish)."""


class VLLMClient(HttpClient):
    """Typed calls to one vLLM server; an async context manager (``aclose()`` on exit).

    Constructing it does no I/O; the connection pool opens on the first call.
    """

    engine = "vLLM"
    config: VLLMClientConfig

    def __init__(self, config: VLLMClientConfig) -> None:
        super().__init__(config)

    async def health(self) -> bool:
        """Whether ``/health`` answers 200 (503 once the engine has died)."""
        reply = await self._call("GET", "/health", idempotent=True, ok=(200, 503))
        return reply.status == 200

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run ``request`` to its end: finished, or aborted with the partial output.

        Raises BackendError on HTTP errors (400: refused) and on a reply that is unreadable
        or does not match the request.
        """
        reply = await self._call(
            "POST",
            "/inference/v1/generate",
            body=request_body(request),
            timeout_s=self.config.generate_timeout_s,
        )
        try:
            return decode_generate_reply(reply.body, request.request_id)
        except (msgspec.DecodeError, ValueError) as exc:
            raise BackendError(
                f"vLLM generate {request.request_id}: bad reply {reply.body[:200]!r}: {exc}"
            ) from exc

    async def score(
        self, request_id: str, token_ids: Sequence[int], *, priority: int = 0
    ) -> tuple[float, ...]:
        """The log-prob of each of ``token_ids`` after the first, given those before it
        (``prompt_logprobs``; one prefill). Raises BackendError as :meth:`generate` does."""
        tokens = list(token_ids)
        reply = await self._call(
            "POST",
            "/inference/v1/generate",
            body=score_body(request_id, tokens, priority),
            timeout_s=self.config.generate_timeout_s,
        )
        try:
            return decode_score_reply(reply.body, request_id, tokens)
        except (msgspec.DecodeError, ValueError) as exc:
            raise BackendError(
                f"vLLM score {request_id}: bad reply {reply.body[:200]!r}: {exc}"
            ) from exc

    async def abort(self, request_id: str) -> None:
        """Abort one request by the id the caller gave it."""
        if not request_id:
            raise ValueError("abort needs a non-empty request_id (use abort_all)")
        body = {"request_ids": [engine_request_id(request_id)]}
        await self._call("POST", "/abort_requests", body=body, idempotent=True)

    async def abort_all(self) -> int:
        """Abort every request the server holds; returns how many there were."""
        reply = await self._call("POST", "/abort_requests", body={}, idempotent=True)
        aborted: _Aborted = decode_reply(reply, _Aborted, "vLLM /abort_requests")
        return aborted.aborted

    async def pause(self, mode: PauseMode = "keep") -> None:
        """``/pause``: ``keep`` freezes in-flight requests, ``abort`` ends them (partial
        outputs), ``wait`` returns once they finish. New requests queue until resume."""
        if mode not in _PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; known: {list(_PAUSE_MODES)}")
        timeout_s = self.config.generate_timeout_s if mode == "wait" else None
        await self._call(
            "POST", "/pause", params={"mode": mode}, idempotent=True, timeout_s=timeout_s
        )

    async def resume(self) -> None:
        """``/resume`` after a pause."""
        await self._call("POST", "/resume", idempotent=True)

    async def is_paused(self) -> bool:
        """Whether the engine is paused."""
        reply = await self._call("GET", "/is_paused", idempotent=True)
        paused: _Paused = decode_reply(reply, _Paused, "vLLM /is_paused")
        return paused.is_paused

    async def load(self) -> VLLMLoad:
        """Running and waiting requests, KV use and cache counters from ``/metrics``."""
        reply = await self._call("GET", "/metrics", idempotent=True)
        try:
            return parse_metrics(reply.body.decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise BackendError(f"vLLM /metrics: {exc}") from exc

    async def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """Drop the prefix cache (due after a weight push: cached KV outlives it).

        Returns False when vLLM refused because requests hold blocks, unless
        ``reset_running_requests`` (which preempts them).
        """
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        reply = await self._call("POST", "/reset_prefix_cache", params=params, idempotent=True)
        result: _Success = decode_reply(reply, _Success, "vLLM /reset_prefix_cache")
        return result.success

    async def update_weight_version(self, version: str) -> None:
        """Label tokens sampled from now on with ``version`` (only a label)."""
        if not version:
            raise ValueError("version must be a non-empty string")
        body = {"new_version": version}
        await self._call("POST", "/update_weight_version", body=body, idempotent=True)

    async def weight_version(self) -> str:
        """The current weight-version label."""
        reply = await self._call("GET", "/weight_info", idempotent=True)
        info: _WeightInfo = decode_reply(reply, _WeightInfo, "vLLM /weight_info")
        return info.weight_version

    async def collective_rpc(
        self, method: str, args: Sequence[str] = (), *, timeout_s: float | None = None
    ) -> list[Any]:
        """Run ``method(*args)`` on every worker of the engine (dev mode; the worker
        extension's methods, :mod:`dynarl.backends.vllm.worker_extension`); each worker's
        result. Arguments are strings (vLLM passes nothing else). Never retried past a
        connection: the method may have run."""
        if not method:
            raise ValueError("collective_rpc needs a method name")
        body = {"method": method, "args": list(args)}
        reply = await self._call("POST", "/collective_rpc", body=body, timeout_s=timeout_s)
        if not reply.body:
            return []
        results: _RpcResults = decode_reply(reply, _RpcResults, f"vLLM /collective_rpc {method}")
        return results.results
