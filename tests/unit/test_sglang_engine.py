"""SGLangEngine and the step plans: idle-safe release, reusable prefixes, metrics.

Re-dispatch after an abort is the runtime's (``test_sglang_server_engine.py`` runs it
against two fake servers)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from dynarl.backends.sglang import SGLangClient
from dynarl.backends.sglang._client import ClientConfig
from dynarl.backends.sglang._control_steps import (
    AddToRouting,
    Continue,
    Pause,
    ReleaseMemory,
    RemoveFromRouting,
    ResumeMemory,
    SyncWeights,
    WaitIdle,
    execute_steps,
    plan_activate,
    plan_deactivate,
    plan_workload_drain,
)
from dynarl.backends.sglang._http_wire import (
    GenerateRequest,
    GenerateResult,
    LoadSnapshot,
    LoadsReply,
    SamplingParams,
)
from dynarl.backends.sglang._sglang_engine import (
    SGLangEngine,
    rollout_report,
    worker_metrics,
)
from dynarl.bus import WorkerMetrics
from dynarl.errors import BackendError
from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._server import FakeSGLangServer


def _engine(server: FakeSGLangServer, **kwargs: object) -> SGLangEngine:
    client = SGLangClient(ClientConfig(base_url=server.url))
    return SGLangEngine(client, engine_id="e0", idle_poll_s=0.005, **kwargs)  # type: ignore[arg-type]


def test_release_waits_for_an_aborted_request_to_leave_before_releasing() -> None:
    async def main() -> None:
        async with FakeSGLangServer(FakeSGLangConfig(step_interval_s=None)) as server:
            async with _engine(server) as engine:
                request = GenerateRequest(
                    rid="r", input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=99)
                )
                pending = asyncio.create_task(engine.generate(request))
                await server.wait_until(lambda s: len(s.waiting) == 1)
                await server.step(2)
                await engine.abort_all()
                release = asyncio.create_task(engine.release_memory())
                await asyncio.sleep(0.05)  # let it poll: the aborted request still runs
                assert not release.done() and not server.scheduler.offloaded
                await server.step()
                await release
                assert (await pending).aborted
                assert server.scheduler.offloaded == {"weights", "kv_cache", "cuda_graph"}
                assert not server.scheduler.crashed

    asyncio.run(main())


def test_without_the_wait_sglang_would_die() -> None:
    async def main() -> None:
        async with FakeSGLangServer(FakeSGLangConfig(step_interval_s=None)) as server:
            async with _engine(server) as engine:
                request = GenerateRequest(
                    rid="r", input_ids=[1], sampling_params=SamplingParams(max_new_tokens=9)
                )
                pending = asyncio.create_task(engine.generate(request))
                await server.wait_until(lambda s: len(s.waiting) == 1)
                await server.step()
                await engine.abort_all()
                with pytest.raises(BackendError, match="HTTP 500"):
                    await engine.client.release_memory()
                assert server.scheduler.crashed
                with pytest.raises(BackendError):
                    await pending

    asyncio.run(main())


def test_resume_refuses_tags_that_were_not_released() -> None:
    async def main() -> None:
        async with FakeSGLangServer() as server, _engine(server) as engine:
            with pytest.raises(ValueError, match="not released"):
                await engine.resume_memory(["weights"])
            await engine.release_memory(["kv_cache"])
            with pytest.raises(ValueError, match="not released"):
                await engine.resume_memory(["kv_cache", "weights"])
            await engine.resume_memory()
            assert not server.scheduler.crashed and not server.scheduler.offloaded

    asyncio.run(main())


def test_each_finished_request_reports_its_reusable_prefix() -> None:
    seen: list[tuple[str, str, int]] = []

    def sink(engine_id: str, request: GenerateRequest, result: GenerateResult) -> None:
        seen.append((engine_id, request.rid, result.cached_tokens))

    async def main() -> None:
        async with FakeSGLangServer() as server, _engine(server, on_finished=sink) as engine:
            params = SamplingParams(max_new_tokens=2)
            await engine.generate(
                GenerateRequest(rid="a", input_ids=[1, 2, 3, 4], sampling_params=params)
            )
            request = GenerateRequest(rid="b", input_ids=[1, 2, 3, 9], sampling_params=params)
            async for _ in engine.generate_stream(request):
                pass

    asyncio.run(main())
    assert seen == [("e0", "a", 0), ("e0", "b", 3)]


def test_worker_metrics_pool_dp_ranks() -> None:
    loads = LoadsReply(
        loads=[
            LoadSnapshot(
                dp_rank=0,
                num_running_reqs=3,
                num_waiting_reqs=1,
                num_used_tokens=300,
                max_total_num_tokens=1000,
                cache_hit_rate=0.5,
            ),
            LoadSnapshot(
                dp_rank=1,
                num_running_reqs=1,
                num_waiting_reqs=4,
                num_used_tokens=100,
                max_total_num_tokens=1000,
                cache_hit_rate=0.1,
            ),
        ]
    )
    metrics = worker_metrics(
        loads, component="rollout", worker=2, time=5.0, interval_s=1.0, completed=7
    )
    assert metrics.utilization == pytest.approx(0.2)
    assert (metrics.queue_depth, metrics.in_flight, metrics.completed) == (5, 4, 7)
    assert metrics.cache_hit_rate == pytest.approx(0.3)


def test_rollout_report_aggregates_engines_in_worker_order() -> None:
    def worker(index: int, utilization: float, waiting: int, done: int) -> WorkerMetrics:
        return WorkerMetrics(
            component="rollout",
            worker=index,
            time=2.0,
            interval_s=0.5,
            utilization=utilization,
            queue_depth=waiting,
            completed=done,
        )

    report = rollout_report(
        "rollout",
        [worker(1, 0.9, 2, 3), worker(0, 0.1, 1, 1)],
        time=2.0,
        interval_s=0.5,
        remaining=7,
    )
    assert report.utilization == (0.1, 0.9)
    assert (report.queue_depth, report.completed, report.throughput) == (3, 4, 8.0)
    assert (report.kind, report.remaining) == ("rollout", 7)
    with pytest.raises(ValueError, match="one WorkerMetrics per worker"):
        rollout_report("rollout", [worker(0, 0, 0, 0)] * 2, time=0, interval_s=1)


def test_plans_follow_the_hybrid_protocol() -> None:
    assert plan_deactivate(release_tags=["kv_cache", "weights"], idle_timeout_s=5) == (
        RemoveFromRouting(),
        Pause(mode="abort"),
        WaitIdle(timeout_s=5),
        ReleaseMemory(tags=("weights", "kv_cache")),
    )
    assert plan_workload_drain()[-1] == ReleaseMemory()
    assert plan_activate(released_tags=["kv_cache"], weights_stale=False) == (
        ResumeMemory(tags=("kv_cache",)),
        Continue(),
        AddToRouting(),
    )
    activate = plan_activate(released_tags=["weights", "kv_cache"], weights_stale=False)
    assert activate[:2] == (ResumeMemory(tags=("weights", "kv_cache")), SyncWeights())
    backed_up = plan_activate(
        released_tags=["weights"], weights_stale=False, weights_backed_up=True
    )
    assert SyncWeights() not in backed_up
    with pytest.raises(ValueError, match="memory tags"):
        plan_deactivate(release_tags=["vram"])


class _Recorder:
    engine_id = "e9"

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def pause(self, mode: str = "abort") -> None:
        self.calls.append(f"pause:{mode}")

    async def continue_generation(self) -> None:
        self.calls.append("continue")

    async def wait_idle(
        self, *, timeout_s: float | None = None, ignore_waiting: bool = False
    ) -> object:
        self.calls.append(f"idle:{timeout_s}")
        return None

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self.calls.append(f"release:{','.join(tags or ())}")

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.calls.append(f"resume:{','.join(tags or ())}")


def test_execute_steps_runs_plans_in_order_and_checks_its_collaborators() -> None:
    recorder = _Recorder()
    routing: list[str] = []

    class Router:
        def remove_engine(self, engine_id: str) -> None:
            routing.append(f"-{engine_id}")

        def add_engine(self, engine_id: str) -> None:
            routing.append(f"+{engine_id}")

    async def sync(engine_id: str) -> None:
        recorder.calls.append(f"sync:{engine_id}")

    steps = plan_deactivate(idle_timeout_s=3) + plan_activate(
        released_tags=["weights"], weights_stale=False
    )
    asyncio.run(execute_steps(steps, engine=recorder, router=Router(), sync_weights=sync))
    assert recorder.calls == [
        "pause:abort",
        "idle:3",
        "release:weights,kv_cache,cuda_graph",
        "resume:weights",
        "sync:e9",
        "continue",
    ]
    assert routing == ["-e9", "+e9"]
    with pytest.raises(ValueError, match="no router"):
        asyncio.run(execute_steps(plan_workload_drain(), engine=recorder))
    with pytest.raises(ValueError, match="no weight syncer"):
        asyncio.run(execute_steps([SyncWeights()], engine=recorder))
