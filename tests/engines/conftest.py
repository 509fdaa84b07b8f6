"""Two real vLLM servers for the engine tests, on the tiny random Llama written here (no
hub).

vLLM runs in the interpreter named by ``DYNARL_VLLM_PYTHON`` (default: this one), which
also writes the model. Without vLLM there the tests that need it are skipped, with that
reason. Each server is started once, on a loop of its own, and stopped with its whole
process group after the last engine test; its log stays in the session's temporary
directory. The SGLang tests' two servers (the fake, and a real one where it can run) are
started once as well. Where this process may use two cores or more, each server runs on one of them
(the first on the first core, the second on the second: one engine per core, as a pinned
job runs them); on fewer, both share what there is and the tests oversubscribe it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch
from vllm_support import ENGINE_PYTHON, server_config, write_tiny_llama

from dynarl.backends.sglang import SGLangServer
from dynarl.backends.vllm import VLLMServer, missing_vllm

from .sglang_support import SGLANG_PYTHON, fake_server_config, missing_sglang
from .sglang_support import server_config as sglang_server_config
from .sglang_targets import HIDDEN, NORM, Target, serving


@pytest.fixture(scope="session")
def engine_python() -> str:
    """The interpreter that runs vLLM; skips the test where it has none."""
    reason = missing_vllm(ENGINE_PYTHON)
    if reason is not None:
        pytest.skip(reason)
    return ENGINE_PYTHON


@pytest.fixture(scope="session")
def tiny_model(engine_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama (seed 0)."""
    return write_tiny_llama(engine_python, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="package")
def vllm_servers(
    engine_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VLLMServer, VLLMServer]]:
    """Two running vLLM servers on the same model, started together (each takes half a
    minute or more), shared by the engine tests and stopped after the last of them (an idle
    server still spends CPU)."""
    cores = sorted(os.sched_getaffinity(0))
    pinned = len(cores) >= 2
    servers = tuple(
        VLLMServer(
            dataclasses.replace(
                server_config(engine_python, tiny_model, tmp_path_factory.mktemp("logs")),
                cpus=(cores[index],) if pinned else (),
                cpu_omp_threads_bind=None if pinned else "nobind",  # pinned: bound to its core
            )
        )
        for index in range(2)
    )

    async def each(step: Callable[[VLLMServer], Awaitable[None]]) -> None:
        await asyncio.gather(*(step(server) for server in servers))

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(each(VLLMServer.start))
        yield servers
    finally:
        loop.run_until_complete(each(VLLMServer.aclose))
        loop.close()


@pytest.fixture(scope="package")
def vllm_server(vllm_servers: tuple[VLLMServer, VLLMServer]) -> VLLMServer:
    """The first server (most tests need one)."""
    return vllm_servers[0]


@pytest.fixture(scope="package")
def vllm_server_b(vllm_servers: tuple[VLLMServer, VLLMServer]) -> VLLMServer:
    """The second server (the tests that move work between engines)."""
    return vllm_servers[1]


@pytest.fixture(scope="package")
def fake_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """The fake SGLang server, in a process of its own (for the SGLang conformance and role
    tests)."""
    norm = torch.ones(HIDDEN)
    weights = tmp_path_factory.mktemp("fake-model") / "weights.pt"
    torch.save({NORM: norm}, weights)
    log = tmp_path_factory.mktemp("logs") / "fake-sglang.log"
    with serving(SGLangServer(fake_server_config(weights, log))) as url:
        yield Target("fake", url, norm)


@pytest.fixture(scope="package")
def real_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """A real SGLang server from ``make sglang-env``'s environment, or a skip saying why
    there is none."""
    reason = missing_sglang()
    if reason is not None:
        pytest.skip(reason)
    safetensors = pytest.importorskip("safetensors.torch")
    model = write_tiny_llama(str(SGLANG_PYTHON), tmp_path_factory.mktemp("tiny-llama"))
    norm = safetensors.load_file(str(model / "model.safetensors"))[NORM]
    log = tmp_path_factory.mktemp("logs") / "sglang.log"
    with serving(SGLangServer(sglang_server_config(model, log))) as url:
        yield Target("real", url, norm)


@pytest.fixture(scope="module", params=["fake", pytest.param("real", marks=pytest.mark.engines)])
def target(request: pytest.FixtureRequest) -> Target:
    """Each server in turn."""
    found: Target = request.getfixturevalue(f"{request.param}_target")
    return found
