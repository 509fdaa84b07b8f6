"""SGLangClient: deadlines, bounded retries only where they cannot do harm, error mapping."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from dynarl.backends.sglang import SGLangClient
from dynarl.backends.sglang._client import ClientConfig
from dynarl.backends.sglang._http_wire import GenerateRequest
from dynarl.backends.sglang._server_launcher import free_port
from dynarl.errors import BackendError


class _Flaky:
    """A server whose endpoints fail ``failures`` times with ``status`` before answering."""

    def __init__(self, failures: int, status: int = 503, delay_s: float = 0.0) -> None:
        self.failures = failures
        self.status = status
        self.delay_s = delay_s
        self.hits: dict[str, int] = {}

    async def handle(self, request: web.Request) -> web.Response:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.hits[request.path] <= self.failures:
            return web.Response(status=self.status, text="busy")
        if request.path == "/v1/loads":
            return web.json_response({"loads": [{"num_running_reqs": 2}]})
        if request.path == "/generate":
            return web.json_response({"text": "", "output_ids": [], "meta_info": {"id": "r"}})
        return web.Response(status=200)


@contextlib.asynccontextmanager
async def _serve(flaky: _Flaky) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", flaky.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def _config(url: str, **overrides: Any) -> ClientConfig:
    return ClientConfig(base_url=url, backoff_s=0.001, max_backoff_s=0.002, **overrides)


def test_idempotent_reads_are_retried_until_success() -> None:
    async def main() -> None:
        flaky = _Flaky(failures=2)
        async with _serve(flaky) as url, SGLangClient(_config(url)) as client:
            loads = await client.loads()
        assert loads.loads[0].num_running_reqs == 2
        assert flaky.hits["/v1/loads"] == 3

    asyncio.run(main())


def test_retries_are_bounded() -> None:
    async def main() -> None:
        flaky = _Flaky(failures=10)
        async with _serve(flaky) as url, SGLangClient(_config(url, num_attempts=3)) as client:
            with pytest.raises(BackendError, match="HTTP 503"):
                await client.abort_all()
        assert flaky.hits["/abort_request"] == 3

    asyncio.run(main())


def test_generate_and_memory_calls_are_never_retried_once_sent() -> None:
    async def main() -> None:
        flaky = _Flaky(failures=1)
        async with _serve(flaky) as url, SGLangClient(_config(url)) as client:
            with pytest.raises(BackendError, match="HTTP 503"):
                await client.generate(GenerateRequest(rid="r", input_ids=[1]))
            with pytest.raises(BackendError, match="HTTP 503"):
                await client.resume_memory(["weights"])
        assert flaky.hits == {"/generate": 1, "/resume_memory_occupation": 1}

    asyncio.run(main())


def test_a_timed_out_generate_is_not_resent() -> None:
    async def main() -> None:
        flaky = _Flaky(failures=0, delay_s=1.0)
        async with _serve(flaky) as url:
            config = _config(url, generate_timeout_s=0.2)
            async with SGLangClient(config) as client:
                with pytest.raises(BackendError, match="failed"):
                    await client.generate(GenerateRequest(rid="r", input_ids=[1]))
        assert flaky.hits["/generate"] == 1

    asyncio.run(main())


def test_connection_refused_is_retried_then_reported() -> None:
    async def main() -> None:
        config = _config(f"http://127.0.0.1:{free_port()}", num_attempts=2)
        async with SGLangClient(config) as client:
            with pytest.raises(BackendError, match="cannot connect"):
                await client.generate(GenerateRequest(rid="r", input_ids=[1]))

    asyncio.run(main())


def test_config_and_argument_checks() -> None:
    with pytest.raises(ValueError, match="base_url"):
        ClientConfig(base_url="127.0.0.1:1")
    with pytest.raises(ValueError, match="num_attempts"):
        ClientConfig(base_url="http://h", num_attempts=0)
    with pytest.raises(ValueError, match="exactly one"):
        GenerateRequest(rid="r")
    client = SGLangClient(ClientConfig(base_url="http://h"))
    with pytest.raises(ValueError, match="unknown memory tags"):
        asyncio.run(client.release_memory(["gpu"]))
