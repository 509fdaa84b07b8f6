"""``/generate`` of the fake: validation as SGLang does it, then the simulated scheduler.

Order of checks (as in ``http_server.py`` and ``tokenizer_manager.py``): body validation
(400 ``ErrorResponse``), the JSON contract gate on the raw body (400 ``{"error": text}``),
then the tokenizer manager's checks (400 ``{"error": {"message": ...}}``): inputs, rid
uniqueness (before waiting out a pause), lengths (after). A streamed request reports the
tokenizer manager's errors as an ``{"error": ...}`` event with status 200, as SGLang does.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from dynarl.testing.sglang_fake import _schema as schema
from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._replies import (
    http_error,
    json_reply,
    validation_error,
    value_error,
)
from dynarl.testing.sglang_fake._scheduler import FakeScheduler, Req, SchedulerCrashed

__all__ = ["GenerationEndpoints"]


class GenerationEndpoints:
    """The ``/generate`` handler over a scheduler that exists once the server started."""

    def __init__(self, config: FakeSGLangConfig, scheduler: Callable[[], FakeScheduler]) -> None:
        self.config = config
        self._scheduler = scheduler

    @property
    def scheduler(self) -> FakeScheduler:
        """The running server's scheduler."""
        return self._scheduler()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``POST``/``PUT /generate``: one request, JSON reply or server-sent events."""
        raw = await request.read()
        try:
            body = schema.decode_body(raw, schema.GenerateReqInput)
        except ValueError as exc:
            return validation_error(str(exc))
        contract_error = schema.generate_contract_error(msgspec.json.decode(raw))
        if contract_error is not None:
            return json_reply({"error": contract_error}, 400)
        if (
            isinstance(body.rid, list)
            or isinstance(body.text, list)
            or isinstance(body.sampling_params, list)
            or (body.input_ids and isinstance(body.input_ids[0], list))
            or isinstance(body.return_logprob, list)
        ):
            return value_error("FakeSGLangServer does not model batch requests")
        sampling = dict(body.sampling_params) if isinstance(body.sampling_params, dict) else {}
        if int(sampling.get("n") or 1) != 1:
            return value_error("FakeSGLangServer does not model n > 1")
        if body.stream:
            return await self._stream(request, body, sampling)
        try:
            out = await self._run(body, sampling)
        except ValueError as exc:
            return value_error(str(exc))
        except SchedulerCrashed as exc:
            return value_error(f"FakeSGLangServer: scheduler died: {exc}", 503)
        reason = out["meta_info"]["finish_reason"]
        status = reason.get("status_code") if isinstance(reason, dict) else None
        if status is not None and 400 <= status < 600:
            if status == 400:
                return value_error(reason["message"])
            return http_error(status, reason["message"])
        return json_reply(out)

    def _prompt(self, body: schema.GenerateReqInput) -> list[int]:
        if body.input_ids is not None:
            return [int(token) for token in body.input_ids]
        if body.text is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        return [ord(char) for char in body.text]

    def _check_lengths(self, prompt: list[int], sampling: dict[str, Any]) -> None:
        context = self.config.context_length
        if len(prompt) >= context:
            raise ValueError(
                f"The input ({len(prompt)} tokens) is longer than the model's context "
                f"length ({context} tokens)."
            )
        max_new = sampling.get("max_new_tokens")
        if max_new is not None and max_new + len(prompt) > context:
            raise ValueError(
                "Requested token count exceeds the model's maximum context length "
                f"of {context} tokens. You requested a total of {max_new + len(prompt)} "
                f"tokens: {len(prompt)} tokens from the input messages and "
                f"{max_new} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )

    def _priority(self, body: schema.GenerateReqInput) -> int | None:
        priority = body.priority
        if priority is None and self.config.enable_priority_scheduling:
            priority = self.config.default_priority_value
        if priority is not None and not -(1 << 63) <= priority < (1 << 63):
            raise ValueError(
                "priority must be a signed 64-bit integer "
                "between -9223372036854775808 and 9223372036854775807"
            )
        return priority

    def _logprob_start_len(self, body: schema.GenerateReqInput) -> int:
        start = body.logprob_start_len
        if body.return_logprob is not True or not isinstance(start, int) or start < 0:
            return -1
        prompt_len = len(self._prompt(body))
        if start > prompt_len:
            raise ValueError(
                f"req.logprob_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={prompt_len}. Please use a smaller logprob_start_len."
            )
        return start

    async def _admit(self, body: schema.GenerateReqInput, sampling: dict[str, Any]) -> Req:
        """The tokenizer manager's path: register, wait out pauses, validate, enqueue."""
        scheduler = self.scheduler
        if body.text is None and body.input_ids is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        req = scheduler.new_req(
            rid=body.rid if isinstance(body.rid, str) and body.rid else uuid.uuid4().hex,
            prompt=self._prompt(body),
            sampling=sampling,
            priority=self._priority(body),
            stream=body.stream,
            return_logprob=body.return_logprob is True,
            logprob_start_len=self._logprob_start_len(body),
        )
        scheduler.register(req)
        await scheduler.notify()
        try:
            await scheduler.wait_dispatchable()
            self._check_lengths(req.prompt, sampling)
            await scheduler.enqueue(req)
        except BaseException:
            scheduler.unregister(req)
            raise
        return req

    async def _run(self, body: schema.GenerateReqInput, sampling: dict[str, Any]) -> dict[str, Any]:
        req = await self._admit(body, sampling)
        out: dict[str, Any] = await req.chunks.get()
        if "crash" in out:
            raise SchedulerCrashed(out["crash"])
        return out

    async def _stream(
        self, request: web.Request, body: schema.GenerateReqInput, sampling: dict[str, Any]
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        req = None
        try:
            req = await self._admit(body, sampling)
            while True:
                out = await req.chunks.get()
                if "crash" in out:
                    raise SchedulerCrashed(out["crash"])
                await response.write(b"data: " + msgspec.json.encode(out) + b"\n\n")
                if out["meta_info"]["finish_reason"] is not None:
                    break
        except (ValueError, SchedulerCrashed) as exc:
            error = {
                "message": str(exc),
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
            await response.write(b"data: " + msgspec.json.encode({"error": error}) + b"\n\n")
        except ConnectionResetError:
            if req is not None:
                self.scheduler.abort(req.rid, abort_all=False)
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
