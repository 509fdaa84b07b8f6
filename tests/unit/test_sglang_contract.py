"""Contract tests: the SGLang adapter against a server, fake or real.

Each test runs against :class:`dynarl.testing.FakeSGLangServer`, and again against a real
SGLang 0.5.23 server when ``DYNARL_SGLANG_URL`` is set (skipped otherwise). The real server
must be started with ``--enable-memory-saver`` and ``--enable-priority-scheduling``; set
``DYNARL_SGLANG_ADMIN_KEY``/``DYNARL_SGLANG_API_KEY`` if it has keys. It must be otherwise
unused: the tests pause, flush and release it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from dynarl.backends.serving import EngineRequest, VersionSpan
from dynarl.backends.sglang import SGLangClient, SGLangServerEngine
from dynarl.backends.sglang._client import ClientConfig
from dynarl.backends.sglang._control_steps import execute_steps, plan_activate, plan_deactivate
from dynarl.backends.sglang._http_wire import GenerateRequest, SamplingParams
from dynarl.backends.sglang._sglang_engine import SGLangEngine
from dynarl.errors import BackendError
from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._server import FakeSGLangServer

REAL_URL = os.environ.get("DYNARL_SGLANG_URL")
TARGETS = [
    "fake",
    pytest.param(
        "real", marks=pytest.mark.skipif(not REAL_URL, reason="DYNARL_SGLANG_URL is not set")
    ),
]
# Long enough to still be running when the test aborts it, on either server.
LONG = SamplingParams(max_new_tokens=1500, ignore_eos=True)


@contextlib.asynccontextmanager
async def _engine(target: str) -> AsyncIterator[SGLangEngine]:
    if target == "real":
        assert REAL_URL is not None
        config = ClientConfig(
            base_url=REAL_URL,
            api_key=os.environ.get("DYNARL_SGLANG_API_KEY"),
            admin_api_key=os.environ.get("DYNARL_SGLANG_ADMIN_KEY"),
        )
        async with SGLangEngine(SGLangClient(config), engine_id="real") as engine:
            yield engine
        return
    fake = FakeSGLangConfig(
        admin_api_key="admin",
        context_length=4096,
        max_total_num_tokens=65536,
        enable_priority_scheduling=True,
    )
    async with FakeSGLangServer(fake) as server:
        config = ClientConfig(base_url=server.url, admin_api_key="admin")
        async with SGLangEngine(SGLangClient(config), engine_id="fake") as engine:
            yield engine


def _run(target: str, test: Callable[[SGLangEngine], Awaitable[None]]) -> None:
    async def main() -> None:
        async with _engine(target) as engine:
            await test(engine)

    asyncio.run(main())


def _rid() -> str:
    return f"dynarl-{uuid.uuid4().hex[:12]}"


async def _until_running(engine: SGLangEngine, count: int = 1) -> None:
    async with asyncio.timeout(30):
        while True:
            loads = await engine.client.loads()
            if sum(rank.num_running_reqs for rank in loads.loads) >= count:
                return
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("target", TARGETS)
def test_generate_reports_tokens_and_reusable_prefix(target: str) -> None:
    async def test(engine: SGLangEngine) -> None:
        assert await engine.client.health()
        prompt = [11, 12, 13, 14, 15, 16, 17, 18]
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        first = await engine.generate(
            GenerateRequest(rid=_rid(), input_ids=prompt, sampling_params=params, priority=1)
        )
        second = await engine.generate(
            GenerateRequest(rid=_rid(), input_ids=[*prompt, 99], sampling_params=params)
        )
        assert first.finish_reason is not None and first.finish_reason.type == "length"
        assert len(first.output_ids) == first.completion_tokens == 4
        assert first.prompt_tokens == len(prompt)
        assert second.cached_tokens >= len(prompt) - 1

    _run(target, test)


@pytest.mark.parametrize("target", TARGETS)
def test_streaming_ends_with_the_final_result(target: str) -> None:
    async def test(engine: SGLangEngine) -> None:
        params = SamplingParams(max_new_tokens=5, ignore_eos=True)
        request = GenerateRequest(rid=_rid(), input_ids=[3, 1, 4], sampling_params=params)
        results = [result async for result in engine.generate_stream(request)]
        assert results[-1].finished and len(results[-1].output_ids) == 5
        assert all(not result.finished for result in results[:-1])

    _run(target, test)


@pytest.mark.parametrize("target", TARGETS)
def test_abort_by_rid_returns_the_partial_output(target: str) -> None:
    async def test(engine: SGLangEngine) -> None:
        request = GenerateRequest(rid=_rid(), input_ids=[1, 2, 3], sampling_params=LONG)
        async with asyncio.TaskGroup() as tasks:
            pending = tasks.create_task(engine.generate(request))
            await _until_running(engine)
            await engine.abort(request.rid)
        result = pending.result()
        assert result.aborted and 0 < len(result.output_ids) < LONG.max_new_tokens

    _run(target, test)


@pytest.mark.parametrize("target", TARGETS)
def test_the_engine_protocol_reads_logprobs_and_spans_across_a_version_change(
    target: str,
) -> None:
    async def test(engine: SGLangEngine) -> None:
        config, version = engine.client.config, _rid()
        long = EngineRequest(
            request_id=_rid(), token_ids=(1, 2, 3), max_new_tokens=1500, ignore_eos=True
        )
        async with (
            SGLangServerEngine(url=config.base_url, client=config) as adapter,
            asyncio.TaskGroup() as tasks,
        ):
            pending = tasks.create_task(adapter.generate(long))
            await _until_running(engine)
            await adapter.set_weight_version(version)  # without aborting the long one
            short = await adapter.generate(
                EngineRequest(
                    request_id=_rid(), token_ids=(4, 5), max_new_tokens=4, ignore_eos=True
                )
            )
            await adapter.abort(long.request_id)
        partial = pending.result()
        assert short.finish == "length" and short.versions == (VersionSpan(version, 0, 4),)
        assert len(short.logprobs) == 4 and all(logprob <= 0 for logprob in short.logprobs)
        assert partial.aborted and 0 < len(partial.token_ids) < long.max_new_tokens
        assert len(partial.logprobs) == len(partial.token_ids)
        assert partial.token_versions()[-1] == version

    _run(target, test)


@pytest.mark.parametrize("target", TARGETS)
def test_abort_all_then_wait_idle_then_release_and_resume(target: str) -> None:
    async def test(engine: SGLangEngine) -> None:
        requests = [
            GenerateRequest(rid=_rid(), input_ids=[i, 7], sampling_params=LONG) for i in range(3)
        ]
        async with asyncio.TaskGroup() as tasks:
            pending = [tasks.create_task(engine.generate(r)) for r in requests]
            await _until_running(engine, 3)
            await engine.abort_all()
        assert all(task.result().aborted for task in pending)
        await engine.release_memory(["kv_cache"])
        assert engine.released_tags == {"kv_cache"}
        await engine.resume_memory()
        assert engine.released_tags == frozenset()
        after = await engine.generate(
            GenerateRequest(
                rid=_rid(), input_ids=[5], sampling_params=SamplingParams(max_new_tokens=2)
            )
        )
        assert after.finished and not after.aborted

    _run(target, test)


@pytest.mark.parametrize("target", TARGETS)
def test_pause_retract_then_continue_completes_the_request(target: str) -> None:
    async def test(engine: SGLangEngine) -> None:
        params = SamplingParams(max_new_tokens=200, ignore_eos=True)
        request = GenerateRequest(rid=_rid(), input_ids=[8, 8, 8], sampling_params=params)
        async with asyncio.TaskGroup() as tasks:
            pending = tasks.create_task(engine.generate(request))
            await _until_running(engine)
            await engine.pause("retract")
            # While paused in retract mode SGLang 0.5.23 reports the last step's figures
            # (the retracted request still running; measured against the real server in
            # tests/engines/test_sglang_conformance.py), so an idle wait would never end.
            loads = await engine.client.loads()
            counts = [(r.num_running_reqs, r.num_waiting_reqs) for r in loads.loads]
            assert counts == [(1, 0)]
            await engine.release_memory(["kv_cache"])  # retracted: nothing to wait for
            await engine.resume_memory()
            await engine.continue_generation()
        result = pending.result()
        assert len(result.output_ids) == 200 and result.num_retractions >= 1

    _run(target, test)


@pytest.mark.parametrize("target", TARGETS)
def test_weight_update_outside_a_session_is_refused(target: str) -> None:
    async def test(engine: SGLangEngine) -> None:
        refused = await engine.client.update_weights_from_distributed(
            names=["model.norm.weight"], dtypes=["bfloat16"], shapes=[[8]]
        )
        assert not refused.success
        assert refused.message == (
            "update_weights_from_distributed must run between "
            "begin_weight_update() and end_weight_update()"
        )
        assert not (await engine.client.end_weight_update()).success

    _run(target, test)


@pytest.mark.parametrize("target", TARGETS)
def test_loads_map_to_worker_metrics(target: str) -> None:
    async def test(engine: SGLangEngine) -> None:
        request = GenerateRequest(rid=_rid(), input_ids=list(range(40, 80)), sampling_params=LONG)
        async with asyncio.TaskGroup() as tasks:
            pending = tasks.create_task(engine.generate(request))
            await _until_running(engine)
            metrics = await engine.metrics(component="rollout", worker=3, time=1.0, interval_s=1.0)
            await engine.abort(request.rid)
        assert pending.result().aborted
        assert (metrics.component, metrics.worker, metrics.in_flight) == ("rollout", 3, 1)
        assert 0.0 < metrics.utilization <= 1.0
        assert 0.0 <= metrics.cache_hit_rate <= 1.0

    _run(target, test)


class _Router:
    def __init__(self) -> None:
        self.log: list[str] = []

    def remove_engine(self, engine_id: str) -> None:
        self.log.append(f"-{engine_id}")

    def add_engine(self, engine_id: str) -> None:
        self.log.append(f"+{engine_id}")


@pytest.mark.parametrize("target", TARGETS)
def test_deactivate_then_activate_round_trip(target: str) -> None:
    async def test(engine: SGLangEngine) -> None:
        router, synced = _Router(), []

        async def sync(engine_id: str) -> None:
            synced.append(engine_id)

        request = GenerateRequest(rid=_rid(), input_ids=[2, 7, 1], sampling_params=LONG)
        async with asyncio.TaskGroup() as tasks:
            pending = tasks.create_task(engine.generate(request))
            await _until_running(engine)
            await execute_steps(
                plan_deactivate(release_tags=["kv_cache"]), engine=engine, router=router
            )
        assert pending.result().aborted
        assert engine.released_tags == {"kv_cache"} and engine.paused == "abort"
        steps = plan_activate(released_tags=sorted(engine.released_tags), weights_stale=True)
        await execute_steps(steps, engine=engine, router=router, sync_weights=sync)
        assert router.log == [f"-{engine.engine_id}", f"+{engine.engine_id}"]
        assert synced == [engine.engine_id] and engine.paused is None
        done = await engine.generate(
            GenerateRequest(
                rid=_rid(), input_ids=[1], sampling_params=SamplingParams(max_new_tokens=2)
            )
        )
        assert done.finished and not done.aborted

    _run(target, test)


@pytest.mark.parametrize("target", TARGETS)
def test_wait_idle_gives_up_while_a_request_is_frozen(target: str) -> None:
    async def test(engine: SGLangEngine) -> None:
        request = GenerateRequest(rid=_rid(), input_ids=[4, 4], sampling_params=LONG)
        async with asyncio.TaskGroup() as tasks:
            pending = tasks.create_task(engine.generate(request))
            await _until_running(engine)
            await engine.pause("in_place")
            with pytest.raises(BackendError, match="not idle"):
                await engine.wait_idle(timeout_s=0.3)
            await engine.continue_generation()
            await engine.abort(request.rid)
        assert pending.result().aborted

    _run(target, test)
