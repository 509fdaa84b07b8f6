"""What the SGLang conformance and role tests share: the servers under test (fake and
real) and raw HTTP and engine helpers (``test_sglang_conformance.py``,
``test_sglang_role.py``; the fixtures are in ``conftest.py``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest
import torch
from vllm_support import prompt

from dynarl.backends.sglang import SGLangServer, SGLangServerEngine

from .sglang_support import WAIT_S

LONG = 600
"""Tokens of a request that must still run while the test acts on it (about 3 s on the
fake, more on the real server)."""
SETTLE_S = 0.3
"""Pause after a request is seen running, so that it has produced tokens."""
NORM = "model.norm.weight"
"""The tensor the weight-update scenario broadcasts: the server's own value, so that the
model does not change."""
HIDDEN = 128
"""Hidden size of the tiny Llama."""
ATTEMPTS = 4
LOGPROB_TOL = 1e-4
"""fp32 log-probs of the same tokens computed along different paths (recompute after a
retraction against step-by-step decoding)."""


@dataclass(frozen=True)
class Target:
    """A running server under test."""

    kind: str
    url: str
    norm: torch.Tensor
    """Its current ``model.norm.weight``."""


@contextlib.contextmanager
def serving(server: SGLangServer) -> Iterator[str]:
    """Start ``server`` on a loop of its own; stop its process group on exit."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(server.start())
        yield server.url
    finally:
        loop.run_until_complete(server.aclose())
        loop.close()


# ---------------------------------------------------------------------- raw HTTP


class Http:
    """Raw calls to one server: ``(status, JSON body or text or None)``."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        params: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else msgspec.json.encode(body))
        headers = {"Content-Type": "application/json"} if data is not None else {}
        async with self.session.request(
            method, self.url + path, data=data, params=params, headers=headers
        ) as response:
            text = await response.read()
        if not text.strip():
            return response.status, None
        try:
            return response.status, msgspec.json.decode(text)
        except msgspec.DecodeError:
            return response.status, text.decode(errors="replace")

    async def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return await self.call("POST", path, body, **kw)

    async def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return await self.call("GET", path, **kw)

    async def load(self) -> dict[str, Any]:
        status, body = await self.get("/v1/loads", params={"include": "core"})
        assert status == 200, body
        rank: dict[str, Any] = body["loads"][0]
        return rank

    async def wait_load(self, ready: Callable[[dict[str, Any]], bool], what: str) -> None:
        try:
            async with asyncio.timeout(WAIT_S):
                while True:
                    if ready(await self.load()):
                        return
                    await asyncio.sleep(0.02)
        except TimeoutError:
            pytest.fail(f"the server never reached: {what}")

    async def version(self) -> str:
        status, info = await self.get("/model_info")
        assert status == 200, info
        return str(info["weight_version"])


def in_flight(count: int) -> Callable[[dict[str, Any]], bool]:
    """Whether a load shows at least ``count`` requests running or waiting."""
    return lambda load: load["num_running_reqs"] + load["num_waiting_reqs"] >= count


def run_http(target: Target, scenario: Callable[[Http], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        timeout = aiohttp.ClientTimeout(total=WAIT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await scenario(Http(session, target.url))

    return asyncio.run(main())


def body(rid: str, num_tokens: int, seed: int, **extra: Any) -> dict[str, Any]:
    """A greedy, fixed-length ``/generate`` body on a 12-token seeded prompt."""
    return {
        "rid": rid,
        "input_ids": prompt(12, seed),
        "sampling_params": {"max_new_tokens": num_tokens, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        **extra,
    }


def logprobs_ok(reply: dict[str, Any]) -> bool:
    """``output_token_logprobs`` is ``[logprob <= 0, token id, null]`` per output token."""
    triples = reply["meta_info"].get("output_token_logprobs")
    if not isinstance(triples, list) or len(triples) != len(reply["output_ids"]):
        return False
    return all(
        isinstance(lp, float) and lp <= 0 and token == out and text is None
        for (lp, token, text), out in zip(triples, reply["output_ids"], strict=True)
    )


def spans(reply: dict[str, Any], version: str) -> list[tuple[str, int, int]]:
    """``weight_versions`` with the current version written ``"<current>"``."""
    return [
        ("<current>" if span["version"] == version else span["version"], span["start"], span["end"])
        for span in reply["meta_info"].get("weight_versions") or []
    ]


def aborted(reply: dict[str, Any]) -> bool:
    return bool(reply["meta_info"]["finish_reason"]["type"] == "abort")


def partial_view(reply: dict[str, Any], version: str) -> dict[str, Any]:
    """An aborted reply as the adapter reads it, model-independent."""
    meta = reply["meta_info"]
    count = len(reply["output_ids"])
    return {
        "finish": (meta["finish_reason"]["type"], meta["finish_reason"].get("message")),
        "partial": 0 < count < LONG,
        "completion_tokens_agree": meta.get("completion_tokens", count) == count,
        "logprobs_ok": logprobs_ok(reply),
        "spans": spans(reply, version) == [("<current>", 0, count)],
    }


async def is_prefix_of_full_run(http: Http, reply: dict[str, Any], seed: int) -> bool:
    count = len(reply["output_ids"])
    status, full = await http.post("/generate", body(f"full-{seed}-{count}", count, seed))
    return status == 200 and bool(full["output_ids"] == reply["output_ids"])


def run_engine(target: Target, test: Callable[[SGLangServerEngine], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with SGLangServerEngine(url=target.url) as engine:
            return await test(engine)

    return asyncio.run(main())


async def wait_engine(engine: SGLangServerEngine, running: int, waiting: int = 0) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                load = await engine.load()
                if load.running >= running and load.waiting >= waiting:
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail(f"the engine never had {running} running and {waiting} waiting")
