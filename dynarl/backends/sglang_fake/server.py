"""``FakeSGLangServer``: SGLang 0.5.23's native HTTP API on loopback, for CPU tests.

Serves exactly the endpoints dynarl's adapter uses, with SGLang's bodies, defaults, status
codes and messages (``tests/sglang_schema`` pins the field sets to the wheel's), over a
simulated scheduler (:mod:`.scheduler`) and real torch.distributed weight-update groups
(:mod:`.model`). Auth follows ``utils/auth.py``: health probes are always open; with
``admin_api_key`` set, admin endpoints need ``Authorization: Bearer <admin key>``; with
``api_key`` set, normal endpoints need it (and admin ones too when no admin key is set);
refusals are ``401 {"error": "Unauthorized"}``.

Where a real server's scheduler process dies (memory release while busy, resuming memory
that was not released), the fake answers 500 and then 503 everywhere, since a real one
would no longer answer at all. Start it as an async context manager on the test's loop,
or from synchronous code with :meth:`FakeSGLangServer.running_in_thread`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import secrets
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import msgspec
import torch
from aiohttp import web

from dynarl.backends.sglang_fake import schema
from dynarl.backends.sglang_fake.config import FakeSGLangConfig
from dynarl.backends.sglang_fake.model import FakeModel, UpdateGroups
from dynarl.backends.sglang_fake.scheduler import FakeScheduler, SchedulerCrashed

__all__ = ["FakeSGLangServer"]

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
_ADMIN = frozenset(
    {
        "/flush_cache",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/weights_checker",
    }
)
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
_NOT_FLUSHED_AFTER_UPDATE = (
    "Weights were updated, but the cache was not flushed because requests are still "
    "running or queued. Retract or finish them, then call /flush_cache."
)
_VALID_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
_SECTION_NAMES = {"memory": "memory", "disaggregation": "disagg", "queues": "queues"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )


def _validation_error(message: str) -> web.Response:
    """FastAPI ``RequestValidationError`` as SGLang renders it (status 400)."""
    body = {
        "object": "error",
        "message": message,
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
    return _json(body, 400)


def _http_error(status: int, message: str) -> web.Response:
    """FastAPI ``HTTPException`` as SGLang renders it."""
    body = {
        "object": "error",
        "message": message,
        "type": str(status),
        "param": None,
        "code": status,
    }
    return _json(body, status)


def _value_error(message: str, status: int = 400) -> web.Response:
    """``_create_error_response``: ``{"error": {"message": ...}}``."""
    return _json({"error": {"message": message}}, status)


def _bearer_ok(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token, key)


class FakeSGLangServer:
    """A loopback fake of one SGLang server; ``async with FakeSGLangServer(...) as server``.

    ``weights`` (full HF-named tensors) is the model ``/weights_checker`` reports and weight
    updates write into; ``num_key_value_heads`` is needed only for ``tp_size`` above the
    KV-head count. Runs on the event loop that enters it.
    """

    def __init__(
        self,
        config: FakeSGLangConfig | None = None,
        *,
        weights: Mapping[str, torch.Tensor] | None = None,
        num_key_value_heads: int | None = None,
    ) -> None:
        self.config = config or FakeSGLangConfig()
        self.model = FakeModel(
            weights or {},
            tp_size=self.config.tp_size,
            hash_device=self.config.checksum_device,
            num_key_value_heads=num_key_value_heads,
        )
        self._scheduler: FakeScheduler | None = None
        self._groups = UpdateGroups(
            tp_size=self.config.tp_size, timeout_s=self.config.group_timeout_s
        )
        self._session: dict[str, Any] | None = None
        self._flush_pending = False
        self._runner: web.AppRunner | None = None
        self._stepper: asyncio.Task[None] | None = None
        self._port = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def scheduler(self) -> FakeScheduler:
        """The simulated scheduler (for inspecting queues in tests)."""
        assert self._scheduler is not None, "server not started"
        return self._scheduler

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        assert self._runner is not None, "server not started"
        return f"http://{self.config.host}:{self._port}"

    async def __aenter__(self) -> FakeSGLangServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Bind the port and start serving (and stepping, unless stepping is manual)."""
        loop = asyncio.get_running_loop()
        self._scheduler = FakeScheduler(self.config, loop.time)
        app = web.Application(middlewares=[self._auth], client_max_size=1 << 30)
        self._routes(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        self._port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        if self.config.step_interval_s is not None:
            self._stepper = asyncio.create_task(self._step_forever(self.config.step_interval_s))
        logger.info("fake SGLang server listening on %s", self.url)

    async def aclose(self) -> None:
        """Stop stepping, leave weight-update groups, close the port."""
        if self._stepper is not None:
            self._stepper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stepper
            self._stepper = None
        await self._groups.aclose()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _step_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.scheduler.step()

    async def step(self, num_steps: int = 1) -> None:
        """Run scheduler iterations by hand (for ``step_interval_s=None``)."""
        for _ in range(num_steps):
            await self.scheduler.step()
            await asyncio.sleep(0)  # let handlers see this iteration's outputs

    async def wait_until(
        self, predicate: Callable[[FakeScheduler], bool], timeout_s: float = 10.0
    ) -> None:
        """Wait until ``predicate(scheduler)`` holds; TimeoutError after ``timeout_s``."""
        scheduler = self.scheduler
        async with asyncio.timeout(timeout_s), scheduler.changed:
            await scheduler.changed.wait_for(lambda: predicate(scheduler))

    @classmethod
    @contextlib.contextmanager
    def running_in_thread(
        cls,
        config: FakeSGLangConfig | None = None,
        *,
        weights: Mapping[str, torch.Tensor] | None = None,
        timeout_s: float = 10.0,
    ) -> Iterator[FakeSGLangServer]:
        """Serve from a background thread with its own event loop, for synchronous callers.

        The yielded server must only be inspected, not driven, from the caller's thread.
        """
        server = cls(config, weights=weights)
        started = threading.Event()
        loop = asyncio.new_event_loop()
        stop = asyncio.Event()

        async def serve() -> None:
            async with server:
                started.set()
                await stop.wait()

        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
        thread.start()
        try:
            if not started.wait(timeout_s):
                raise TimeoutError("fake SGLang server did not start")
            yield server
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(timeout_s)
            loop.close()

    # ------------------------------------------------------------------ plumbing

    def _routes(self, app: web.Application) -> None:
        get, post = web.get, web.post
        app.add_routes(
            [
                get("/health", self._health),
                get("/health_generate", self._health),
                get("/ready", self._ready),
                get("/model_info", self._model_info),
                post("/generate", self._generate),
                web.put("/generate", self._generate),
                get("/flush_cache", self._flush_cache),
                post("/flush_cache", self._flush_cache),
                post("/pause_generation", self._pause),
                post("/continue_generation", self._continue),
                post("/abort_request", self._abort),
                get("/release_memory_occupation", self._release),
                post("/release_memory_occupation", self._release),
                get("/resume_memory_occupation", self._resume),
                post("/resume_memory_occupation", self._resume),
                post("/init_weights_update_group", self._init_group),
                post("/destroy_weights_update_group", self._destroy_group),
                post("/begin_weight_update", self._begin_update),
                post("/end_weight_update", self._end_update),
                post("/update_weights_from_distributed", self._update_distributed),
                get("/weights_checker", self._weights_checker),
                post("/weights_checker", self._weights_checker),
                get("/v1/loads", self._loads),
            ]
        )

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if not path.startswith(_OPEN_PREFIXES) and request.method != "OPTIONS":
            header = request.headers.get("Authorization")
            admin_key, api_key = self.config.admin_api_key, self.config.api_key
            if path in _ADMIN:
                key = admin_key or api_key
                allowed = key is None or _bearer_ok(header, key)
            else:
                allowed = api_key is None or _bearer_ok(header, api_key)
            if not allowed:
                return _json({"error": "Unauthorized"}, 401)
        if self._scheduler is not None and self._scheduler.crashed and path != "/health":
            return _value_error(f"FakeSGLangServer: scheduler died: {self._scheduler.crashed}", 503)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status in (404, 405):
                return _http_error(exc.status, exc.reason)
            raise

    async def _body(self, request: web.Request, kind: type[schema._Body]) -> schema._Body:
        return schema.decode_body(await request.read(), kind)

    # ------------------------------------------------------------------ health, info

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.scheduler.crashed else 200)

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.scheduler.frontend_paused else 200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.config.model_path,
                "served_model_name": self.config.model_path,
                "tokenizer_path": self.config.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.scheduler.weight_version,
                "load_format": "auto",
            }
        )

    async def _loads(self, request: web.Request) -> web.Response:
        query = request.query
        include = [s.strip() for s in query["include"].split(",")] if "include" in query else None
        if include is not None and not set(include) <= _VALID_SECTIONS:
            invalid = set(include) - _VALID_SECTIONS
            return _http_error(
                400,
                f"Invalid include sections: {invalid}. Valid options: {sorted(_VALID_SECTIONS)}",
            )
        snapshot = self.scheduler.load_snapshot(self.model.nbytes / 1e9)
        if include is not None and "all" not in include:
            for section, name in _SECTION_NAMES.items():
                if name not in include:
                    del snapshot[section]
        dp_rank = query.get("dp_rank")
        loads = [snapshot] if dp_rank in (None, "0") else []
        return _json(
            {
                "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
                "version": SGLANG_VERSION,
                "accelerator": None,
                "num_accelerators": self.config.tp_size,
                "loads": loads,
            }
        )

    # ------------------------------------------------------------------ generate

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = schema.decode_body(raw, schema.GenerateReqInput)
        except ValueError as exc:
            return _validation_error(str(exc))
        contract_error = schema.sampling_params_contract_error(body.sampling_params)
        if contract_error is not None:
            return _json({"error": contract_error}, 400)
        if (
            isinstance(body.rid, list)
            or isinstance(body.text, list)
            or isinstance(body.sampling_params, list)
            or (body.input_ids and isinstance(body.input_ids[0], list))
        ):
            return _value_error("FakeSGLangServer does not model batch requests")
        sampling = dict(body.sampling_params) if isinstance(body.sampling_params, dict) else {}
        if int(sampling.get("n") or 1) != 1:
            return _value_error("FakeSGLangServer does not model n > 1")
        if body.stream:
            return await self._stream(request, body, sampling)
        try:
            out = await self._run(body, sampling)
        except ValueError as exc:
            return _value_error(str(exc))
        except SchedulerCrashed as exc:
            return _value_error(f"FakeSGLangServer: scheduler died: {exc}", 503)
        reason = out["meta_info"]["finish_reason"]
        status = reason.get("status_code") if isinstance(reason, dict) else None
        if status is not None and 400 <= status < 600:
            if status == 400:
                return _value_error(reason["message"])
            return _http_error(status, reason["message"])
        return _json(out)

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

    async def _admit(self, body: schema.GenerateReqInput, sampling: dict[str, Any]) -> Any:
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
        )
        scheduler.register(req)
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

    # ------------------------------------------------------------------ pause, abort, cache

    async def _pause(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.PauseGenerationReqInput)
        except ValueError as exc:
            return _validation_error(str(exc))
        await self.scheduler.pause(body.mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        try:
            await self._body(request, schema.ContinueGenerationReqInput)
        except ValueError as exc:
            return _validation_error(str(exc))
        await self.scheduler.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.AbortReq)
        except ValueError as exc:
            return _validation_error(str(exc))
        self.scheduler.abort(body.rid or "", body.abort_all)
        return web.Response(status=200)

    async def _flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout_s = float(request.query.get("timeout", "0.0"))
        except ValueError:
            return _validation_error("timeout: Input should be a valid number")
        if timeout_s < 0:
            return _validation_error("timeout: Input should be greater than or equal to 0")
        success, message = await self._flush(timeout_s)
        if success:
            return web.Response(text=_FLUSHED)
        return web.Response(text=message or "Flush cache failed.\n", status=400)

    async def _flush(self, timeout_s: float) -> tuple[bool, str]:
        scheduler = self.scheduler
        if self._flush_pending:
            return False, "Another flush_cache is already in progress."
        if timeout_s <= 0 or scheduler.idle():
            return scheduler.flush(), ""
        self._flush_pending = True
        try:
            async with asyncio.timeout(timeout_s), scheduler.changed:
                await scheduler.changed.wait_for(scheduler.idle)
        except TimeoutError:
            return False, "Timed out waiting for idle state."
        finally:
            self._flush_pending = False
        return scheduler.flush(), ""

    # ------------------------------------------------------------------ memory

    async def _release(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.ReleaseMemoryOccupationReqInput)
        except ValueError as exc:
            return _validation_error(str(exc))
        try:
            self.scheduler.release_memory(body.tags)
        except SchedulerCrashed as exc:
            await self.scheduler.notify()
            return _value_error(f"AssertionError: {exc}", 500)
        return _json(None)

    async def _resume(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.ResumeMemoryOccupationReqInput)
        except ValueError as exc:
            return _validation_error(str(exc))
        try:
            resumed = self.scheduler.resume_memory(body.tags)
        except SchedulerCrashed as exc:
            await self.scheduler.notify()
            return _value_error(str(exc), 500)
        saver = self.config.enable_memory_saver and not self.config.enable_weights_cpu_backup
        if "weights" in resumed and saver:
            self.model.zero()
        await self.scheduler.notify()
        return _json(None)

    # ------------------------------------------------------------------ weights

    async def _init_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.InitWeightsUpdateGroupReqInput)
        except ValueError as exc:
            return _validation_error(str(exc))
        success, message = await self._groups.join(body)
        return _json({"success": success, "message": message}, 200 if success else 400)

    async def _destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.DestroyWeightsUpdateGroupReqInput)
        except ValueError as exc:
            return _validation_error(str(exc))
        success, message = await self._groups.leave(body.group_name)
        return _json({"success": success, "message": message}, 200 if success else 400)

    @contextlib.asynccontextmanager
    async def _writer_lock(self) -> Any:
        """The tokenizer's ``model_update_lock.writer_lock``, unless generation is paused."""
        scheduler = self.scheduler
        if scheduler.frontend_paused:
            yield
            return
        scheduler.updating = True
        try:
            await scheduler.wait_drained()
            yield
        finally:
            scheduler.updating = False
            await scheduler.notify()

    async def _begin_update(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.BeginWeightUpdateReqInput)
        except ValueError as exc:
            return _validation_error(str(exc))
        async with self._writer_lock():
            if self._session is not None:
                success, message = (
                    False,
                    ("a weight-update session is already open; call end_weight_update() first"),
                )
            else:
                self._session = {"selector": body.selector, "loaded": False}
                success, message = True, "Success"
        return _json({"success": success, "message": message}, 200 if success else 400)

    async def _end_update(self, request: web.Request) -> web.Response:
        try:
            await self._body(request, schema.EndWeightUpdateReqInput)
        except ValueError as exc:
            return _validation_error(str(exc))
        async with self._writer_lock():
            if self._session is None:
                success, message = (
                    False,
                    ("no weight-update session is open; call begin_weight_update() first"),
                )
            else:
                self._session = None
                success, message = True, "Success"
        return _json({"success": success, "message": message}, 200 if success else 400)

    async def _update_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.UpdateWeightsFromDistributedReqInput)
        except ValueError as exc:
            return _validation_error(str(exc))
        if body.abort_all_requests:
            self.scheduler.abort("", abort_all=True)
        async with self._writer_lock():
            success, message = await self._receive_and_load(body)
        if success and body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return _json({"success": success, "message": message}, 200 if success else 400)

    async def _receive_and_load(
        self, body: schema.UpdateWeightsFromDistributedReqInput
    ) -> tuple[bool, str]:
        if self._session is None:
            return False, (
                "update_weights_from_distributed must run between "
                "begin_weight_update() and end_weight_update()"
            )
        try:
            received = await self._groups.receive(body)
        except Exception as exc:  # SGLang reports any receive failure in the message
            return False, f"Failed to receive weights: {exc}"
        success, message = self.model.load(received)
        if not success:
            return success, message
        self._session["loaded"] = True
        if body.weight_version is not None:
            self.scheduler.weight_version = body.weight_version
        if body.flush_cache and not self.scheduler.flush():
            return False, _NOT_FLUSHED_AFTER_UPDATE
        return True, message

    async def _weights_checker(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = (
                schema.decode_body(raw, schema.CheckWeightsReqInput)
                if raw.strip()
                else schema.CheckWeightsReqInput()
            )
        except ValueError as exc:
            return _validation_error(str(exc))
        if body.action != "checksum":
            message = f"FakeSGLangServer models only action='checksum', not {body.action!r}"
            return _json({"success": False, "message": message}, 400)
        reply = await asyncio.to_thread(self.model.checksum_reply, body.skip_tensor_list)
        return _json(reply)
