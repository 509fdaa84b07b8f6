"""``FakeSGLangServer``: SGLang 0.5.23's native HTTP API on loopback, for CPU tests.

Serves exactly the endpoints dynarl's adapter uses, with SGLang's bodies, defaults, status
codes and messages (``tests/sglang_schema`` pins the field sets to the wheel's), over a
simulated scheduler (:mod:`._scheduler`) and real torch.distributed weight-update groups
(:mod:`._weights`). Auth follows ``utils/auth.py``: health probes are always open; with
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
import copy
import datetime
import logging
import secrets
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import torch
from aiohttp import web

from dynarl.testing.sglang_fake import _schema as schema
from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._generation import GenerationEndpoints
from dynarl.testing.sglang_fake._replies import (
    http_error,
    json_reply,
    load_snapshot,
    validation_error,
    value_error,
)
from dynarl.testing.sglang_fake._scheduler import FakeScheduler, SchedulerCrashed
from dynarl.testing.sglang_fake._weights import FakeModel, WeightEndpoints

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
        "/update_weight_version",
        "/weights_checker",
    }
)
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
_VALID_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
_SECTION_NAMES = {"memory": "memory", "disaggregation": "disagg", "queues": "queues"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
        self._generation = GenerationEndpoints(self.config, lambda: self.scheduler)
        self._weights = WeightEndpoints(self.config, self.model, lambda: self.scheduler)
        self._flush_pending = False
        self._retract_load: dict[str, Any] | None = None
        """The load reported while paused in retract mode (see ``_pause``)."""
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
        await self._weights.aclose()
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
                post("/generate", self._generation.generate),
                web.put("/generate", self._generation.generate),
                get("/flush_cache", self._flush_cache),
                post("/flush_cache", self._flush_cache),
                post("/pause_generation", self._pause),
                post("/continue_generation", self._continue),
                post("/abort_request", self._abort),
                get("/release_memory_occupation", self._release),
                post("/release_memory_occupation", self._release),
                get("/resume_memory_occupation", self._resume),
                post("/resume_memory_occupation", self._resume),
                post("/init_weights_update_group", self._weights.init_group),
                post("/destroy_weights_update_group", self._weights.destroy_group),
                post("/begin_weight_update", self._weights.begin_update),
                post("/end_weight_update", self._weights.end_update),
                post("/update_weights_from_distributed", self._weights.update_distributed),
                post("/update_weight_version", self._update_weight_version),
                get("/weights_checker", self._weights.weights_checker),
                post("/weights_checker", self._weights.weights_checker),
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
                return json_reply({"error": "Unauthorized"}, 401)
        if self._scheduler is not None and self._scheduler.crashed and path != "/health":
            return value_error(f"FakeSGLangServer: scheduler died: {self._scheduler.crashed}", 503)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status in (404, 405):
                return http_error(exc.status, exc.reason)
            raise

    async def _body(self, request: web.Request, kind: type[schema.Body]) -> schema.Body:
        return schema.decode_body(await request.read(), kind)

    # ------------------------------------------------------------------ health, info

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.scheduler.crashed else 200)

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.scheduler.frontend_paused else 200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return json_reply(
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
            # SGLang 0.5.23 means a 400 here but answers a bare 500 (measured).
            return web.Response(status=500, text="Internal Server Error")
        frozen = self._retract_load
        snapshot = (
            copy.deepcopy(frozen)
            if frozen is not None
            else load_snapshot(self.scheduler, self.model.nbytes / 1e9)
        )
        if include is not None and "all" not in include:
            for section, name in _SECTION_NAMES.items():
                if name not in include:
                    del snapshot[section]
        dp_rank = query.get("dp_rank")
        loads = [snapshot] if dp_rank in (None, "0") else []
        return json_reply(
            {
                "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
                "version": SGLANG_VERSION,
                "accelerator": None,
                "num_accelerators": self.config.tp_size,
                "loads": loads,
            }
        )

    # ------------------------------------------------------------------ pause, abort, cache

    async def _pause(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.PauseGenerationReqInput)
        except ValueError as exc:
            return validation_error(str(exc))
        if body.mode == "retract" and self._retract_load is None:
            # SGLang 0.5.23 keeps answering /v1/loads with the last step's figures while
            # paused in retract mode (its running requests still count as running;
            # measured): the snapshot before the pause, until continue.
            self._retract_load = load_snapshot(self.scheduler, self.model.nbytes / 1e9)
        await self.scheduler.pause(body.mode)
        return json_reply({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        try:
            await self._body(request, schema.ContinueGenerationReqInput)
        except ValueError as exc:
            return validation_error(str(exc))
        self._retract_load = None
        await self.scheduler.resume()
        return json_reply({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.AbortReq)
        except ValueError as exc:
            return validation_error(str(exc))
        self.scheduler.abort(body.rid or "", body.abort_all)
        return web.Response(status=200)

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.UpdateWeightVersionReqInput)
        except ValueError as exc:
            return validation_error(str(exc))
        if body.abort_all_requests:
            self.scheduler.abort("", abort_all=True)
        self.scheduler.set_weight_version(body.new_version)
        await self.scheduler.notify()
        message = f"Weight version updated to {body.new_version}"
        return json_reply({"success": True, "message": message, "new_version": body.new_version})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout_s = float(request.query.get("timeout", "0.0"))
        except ValueError:
            return validation_error("timeout: Input should be a valid number")
        if timeout_s < 0:
            return validation_error("timeout: Input should be greater than or equal to 0")
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
            return validation_error(str(exc))
        try:
            self.scheduler.release_memory(body.tags)
        except SchedulerCrashed as exc:
            await self.scheduler.notify()
            return value_error(f"AssertionError: {exc}", 500)
        return json_reply(None)

    async def _resume(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, schema.ResumeMemoryOccupationReqInput)
        except ValueError as exc:
            return validation_error(str(exc))
        try:
            resumed = self.scheduler.resume_memory(body.tags)
        except SchedulerCrashed as exc:
            await self.scheduler.notify()
            return value_error(str(exc), 500)
        saver = self.config.enable_memory_saver and not self.config.enable_weights_cpu_backup
        if "weights" in resumed and saver:
            self.model.zero()
        await self.scheduler.notify()
        return json_reply(None)
