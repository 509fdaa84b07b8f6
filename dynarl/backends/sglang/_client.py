"""An async HTTP client for one SGLang 0.5.23 server's native API.

Every call has a deadline. Retries are bounded and limited to what cannot do harm:

- a call that failed to *connect* (the request never reached the server) is retried,
  whatever the endpoint;
- a call whose connection broke, that timed out, or that got 502/503/504 is retried only if
  the endpoint is idempotent: ``/health``, ``/model_info``, ``/v1/loads``,
  ``/weights_checker``, ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
  ``/flush_cache`` and ``/update_weight_version``. ``/generate`` (would run twice), memory
  release/resume (resume twice is an error), weight-update group and session calls and
  ``/update_weights_from_distributed`` (its broadcast must pair with the trainer's) are
  never retried past a connection.

The transport (deadline, retry rule) is :mod:`dynarl.backends._http`'s. HTTP errors and
unreadable replies raise :class:`~dynarl.errors.BackendError`; the weight
endpoints' ``{"success": false}`` replies come back as :class:`ControlResult` for the caller
to judge. Runs on the caller's event loop; not thread-safe.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from dynarl.backends._http import HttpClient, HttpClientConfig, Reply, decode_reply
from dynarl.backends.sglang._http_wire import (
    MEMORY_TAGS,
    ChecksumReply,
    ControlResult,
    GenerateRequest,
    GenerateResult,
    LoadsReply,
    PauseMode,
    decode_generate_result,
)
from dynarl.errors import BackendError

__all__ = ["ClientConfig", "SGLangClient"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientConfig(HttpClientConfig):
    """How a :class:`SGLangClient` reaches its server (the shared keys of
    :class:`~dynarl.backends._http.HttpClientConfig`, and SGLang's own)."""

    admin_api_key: str | None = None
    """``--admin-api-key`` of the server: sent on admin endpoints when set (else
    ``api_key``)."""
    weight_update_timeout_s: float = 1800.0
    """Deadline for weight-update group and broadcast calls."""


class SGLangClient(HttpClient):
    """Typed calls to one SGLang server; an async context manager (``aclose()`` on exit).

    Runs on the event loop that first uses it.
    """

    engine = "SGLang"
    config: ClientConfig

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)

    def _headers(self, admin: bool) -> dict[str, str]:
        key = self.config.admin_api_key if admin and self.config.admin_api_key else None
        key = key or self.config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    @staticmethod
    def _decode(reply: Reply, kind: type[Any], what: str) -> Any:
        return decode_reply(reply, kind, what)

    # ------------------------------------------------------------------ health, info

    async def health(self) -> bool:
        """Whether ``/health`` answers 200 (503 while starting or shutting down)."""
        reply = await self._call("GET", "/health", idempotent=True, ok=(200, 503))
        return reply.status == 200

    async def model_info(self) -> dict[str, Any]:
        """``/model_info``: model path, ``weight_version`` and friends."""
        reply = await self._call("GET", "/model_info", idempotent=True)
        info: dict[str, Any] = self._decode(reply, dict, "/model_info")
        return info

    async def loads(self, include: str | None = None) -> LoadsReply:
        """``/v1/loads``: one load snapshot per DP rank."""
        params = {"include": include} if include else None
        reply = await self._call("GET", "/v1/loads", params=params, idempotent=True)
        loads: LoadsReply = self._decode(reply, LoadsReply, "/v1/loads")
        return loads

    # ------------------------------------------------------------------ generation

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one request to completion (or abort: the result then holds the partial output).

        Never retried once connected. Raises BackendError on HTTP errors (400: refused).
        """
        body = msgspec.to_builtins(request)
        reply = await self._call(
            "POST", "/generate", body=body, timeout_s=self.config.generate_timeout_s
        )
        try:
            return decode_generate_result(reply.body, request.rid)
        except msgspec.DecodeError as exc:
            raise BackendError(f"SGLang /generate {request.rid}: unreadable reply: {exc}") from exc

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateResult]:
        """Stream one request: cumulative results, the last one finished (or aborted).

        Raises BackendError on HTTP errors and on an ``{"error": ...}`` event.
        """
        body = msgspec.to_builtins(request) | {"stream": True}
        timeout = aiohttp.ClientTimeout(
            total=self.config.generate_timeout_s, connect=self.config.connect_timeout_s
        )
        headers = self._headers(False) | {"Content-Type": "application/json"}
        try:
            async with self._http().post(
                "generate", data=msgspec.json.encode(body), headers=headers, timeout=timeout
            ) as response:
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")[:500]
                    raise BackendError(f"/generate {request.rid} -> HTTP {response.status}: {text}")
                async for result in _sse_results(response.content, request.rid):
                    yield result
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendError(f"/generate {request.rid} stream failed: {exc!r}") from exc

    async def abort(self, rid: str) -> None:
        """Abort one request (SGLang aborts every in-flight rid starting with ``rid``)."""
        if not rid:
            raise ValueError("abort needs a non-empty rid (use abort_all)")
        await self._call("POST", "/abort_request", body={"rid": rid}, admin=True, idempotent=True)

    async def abort_all(self) -> None:
        """Abort every running and waiting request; their callers get partial outputs."""
        await self._call(
            "POST", "/abort_request", body={"abort_all": True}, admin=True, idempotent=True
        )

    async def pause(self, mode: PauseMode = "abort") -> None:
        """``/pause_generation``; new requests wait at the server until continue."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}")
        await self._call(
            "POST", "/pause_generation", body={"mode": mode}, admin=True, idempotent=True
        )

    async def continue_generation(self, *, torch_empty_cache: bool = True) -> None:
        """``/continue_generation``: resume after a pause."""
        body = {} if torch_empty_cache else {"torch_empty_cache": False}
        await self._call("POST", "/continue_generation", body=body, admin=True, idempotent=True)

    async def flush_cache(self, timeout_s: float = 0.0) -> ControlResult:
        """Flush the radix cache; refused (success False) while requests run or wait.

        ``timeout_s`` > 0 makes the server wait that long for idleness first.
        """
        reply = await self._call(
            "POST",
            "/flush_cache",
            params={"timeout": repr(float(timeout_s))},
            admin=True,
            idempotent=True,
            timeout_s=self.config.timeout_s + timeout_s,
            ok=(200, 400),
        )
        return ControlResult(success=reply.status == 200, message=reply.body.decode().strip())

    # ------------------------------------------------------------------ memory

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Release GPU memory by tag (None: all). The server must be idle (it asserts)."""
        await self._call(
            "POST", "/release_memory_occupation", body={"tags": _tags(tags)}, admin=True
        )

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back GPU memory released under ``tags`` (None: all)."""
        await self._call(
            "POST", "/resume_memory_occupation", body={"tags": _tags(tags)}, admin=True
        )

    # ------------------------------------------------------------------ weights

    async def _control(self, path: str, body: dict[str, Any], timeout_s: float) -> ControlResult:
        reply = await self._call(
            "POST", path, body=body, admin=True, timeout_s=timeout_s, ok=(200, 400)
        )
        result: ControlResult = self._decode(reply, ControlResult, path)
        return result

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> ControlResult:
        """Make the server join the trainer's broadcast group (blocks until all joined)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._control(
            "/init_weights_update_group", body, self.config.weight_update_timeout_s
        )

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> ControlResult:
        """Leave and destroy the broadcast group."""
        return await self._control(
            "/destroy_weights_update_group", {"group_name": group_name}, self.config.timeout_s
        )

    async def begin_weight_update(self, selector: str = "all") -> ControlResult:
        """Open a weight-update session (updates outside one are refused)."""
        body = {} if selector == "all" else {"selector": selector}
        return await self._control("/begin_weight_update", body, self.config.timeout_s)

    async def end_weight_update(self) -> ControlResult:
        """Close the weight-update session."""
        return await self._control("/end_weight_update", {}, self.config.timeout_s)

    async def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> ControlResult:
        """Receive one broadcast (one flattened bucket with ``load_format="flattened_bucket"``).

        Returns when the server has received and loaded it, so the trainer's matching
        broadcast must run concurrently.
        """
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(shape) for shape in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._control(
            "/update_weights_from_distributed", body, self.config.weight_update_timeout_s
        )

    async def update_weight_version(
        self, version: str, *, abort_all_requests: bool = False
    ) -> ControlResult:
        """``/update_weight_version``: the label tokens sampled from now on report.

        SGLang's own default aborts every request in flight; this one does not unless
        ``abort_all_requests``.
        """
        body = {"new_version": version, "abort_all_requests": abort_all_requests}
        reply = await self._call(
            "POST", "/update_weight_version", body=body, admin=True, idempotent=True, ok=(200, 400)
        )
        result: ControlResult = self._decode(reply, ControlResult, "/update_weight_version")
        return result

    async def weights_checksum(self, skip_tensor_list: Sequence[str] = ()) -> ChecksumReply:
        """``/weights_checker`` with ``action="checksum"``: per-rank parameter hashes."""
        body: dict[str, Any] = {"action": "checksum"}
        if skip_tensor_list:
            body["skip_tensor_list"] = list(skip_tensor_list)
        reply = await self._call(
            "POST",
            "/weights_checker",
            body=body,
            admin=True,
            idempotent=True,
            timeout_s=self.config.weight_update_timeout_s,
            ok=(200, 400),
        )
        checksums: ChecksumReply = self._decode(reply, ChecksumReply, "/weights_checker")
        return checksums


def _tags(tags: Sequence[str] | None) -> list[str] | None:
    if tags is None:
        return None
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return list(tags)


async def _sse_results(content: aiohttp.StreamReader, rid: str) -> AsyncIterator[GenerateResult]:
    """Parse ``data: {...}`` events until ``data: [DONE]``."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        event = msgspec.json.decode(payload)
        if isinstance(event, dict) and "error" in event:
            raise BackendError(f"/generate {rid} stream error: {event['error']}")
        yield decode_generate_result(event, rid)
    raise BackendError(f"/generate {rid}: stream ended without [DONE]")
