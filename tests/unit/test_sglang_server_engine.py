"""SGLangServerEngine, the engine protocol over SGLang's HTTP API, against the fake server:
token ids, log-probs and weight-version spans out; priority as it is; abort by id; pause
modes; load; weight versions without aborting; EngineSetup; re-dispatch by the runtime."""

from __future__ import annotations

import asyncio
import itertools
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynarl.backends.serving import (
    Engine,
    EngineOutput,
    EngineRequest,
    EngineSetup,
    PauseMode,
    VersionSpan,
)
from dynarl.backends.sglang import SGLangServerConfig, SGLangServerEngine
from dynarl.backends.sglang._http_wire import (
    FinishReason,
    GenerateResult,
    LoadSnapshot,
    LoadsReply,
    WeightVersionSpan,
)
from dynarl.backends.sglang._server_engine import wire_rid
from dynarl.backends.sglang._server_launcher import launch_command
from dynarl.backends.vllm import VLLMEngine, VLLMInProcessEngine
from dynarl.bus import GenerationRequest, Sample, pack_floats, pack_tokens, unpack_tokens
from dynarl.errors import BackendError
from dynarl.runtime import FINISH
from dynarl.runtime.controller._progress import Progress
from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._server import FakeSGLangServer
from dynarl.testing.sglang_fake._versions import next_token

MANUAL = FakeSGLangConfig(step_interval_s=None)


def _request(request_id: str = "a", tokens: Sequence[int] = (1, 2, 3), **kw: Any) -> EngineRequest:
    kw.setdefault("max_new_tokens", 5)
    return EngineRequest(request_id=request_id, token_ids=tuple(tokens), **kw)


def _expected(prompt: Sequence[int], count: int) -> tuple[list[int], list[float]]:
    """The fake model's tokens and log-probs after ``prompt``."""
    sequence, logprobs = list(prompt), []
    for _ in range(count):
        token, logprob = next_token(sequence)
        sequence.append(token)
        logprobs.append(logprob)
    return sequence[len(prompt) :], logprobs


def _spy(engine: SGLangServerEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Record the (path, body) of every call the engine's client makes."""
    sent: list[tuple[str, Any]] = []
    call = engine.client._call

    async def spy(method: str, path: str, **kw: Any) -> Any:
        sent.append((path, kw.get("body")))
        return await call(method, path, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.client, "_call", spy)
    return sent


async def _queued(server: FakeSGLangServer, count: int) -> None:
    """Wait until ``count`` requests are queued or running (enqueueing notifies)."""
    await server.wait_until(lambda s: len(s.waiting) + len(s.running) == count)


def test_generate_returns_token_ids_logprobs_and_version_spans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> tuple[EngineOutput, EngineOutput, list[tuple[str, Any]]]:
        async with FakeSGLangServer() as server, SGLangServerEngine(url=server.url) as engine:
            assert isinstance(engine, Engine)
            assert engine.name == f"sglang@{server.url.removeprefix('http://')}"
            sent = _spy(engine, monkeypatch)
            first = await engine.generate(_request())
            again = await engine.generate(_request("b", max_new_tokens=2))
            return first, again, sent

    first, again, sent = asyncio.run(main())
    tokens, logprobs = _expected((1, 2, 3), 5)
    assert first.token_ids == tuple(tokens) and first.logprobs == tuple(logprobs)
    assert all(logprob < 0 for logprob in first.logprobs)
    assert first.versions == (VersionSpan("default", 0, 5),)
    assert (first.request_id, first.finish, first.prompt_tokens, first.cached_tokens) == (
        "a",
        "length",
        3,
        0,
    )
    assert again.cached_tokens == 2  # SGLang's page of one token: all but the last
    path, body = sent[0]
    assert path == "/generate" and body["rid"] == "1:a" and body["return_logprob"] is True
    assert body["input_ids"] == [1, 2, 3] and body["sampling_params"]["max_new_tokens"] == 5


async def _finish_order(server: FakeSGLangServer) -> list[str]:
    """Step the manual fake one iteration at a time; the order rids leave it."""
    order: list[str] = []
    scheduler = server.scheduler
    while scheduler.in_flight:
        before = set(scheduler.in_flight)
        await server.step()
        order += sorted(before - set(scheduler.in_flight))
    return order


def test_priority_is_sglangs_own_higher_first(monkeypatch: pytest.MonkeyPatch) -> None:
    config = FakeSGLangConfig(
        step_interval_s=None, enable_priority_scheduling=True, max_running_requests=1
    )

    async def main() -> tuple[list[str], list[tuple[str, Any]]]:
        async with FakeSGLangServer(config) as server, SGLangServerEngine(url=server.url) as e:
            sent = _spy(e, monkeypatch)
            running = asyncio.create_task(e.generate(_request("run", max_new_tokens=3)))
            await _queued(server, 1)
            await server.step()
            low = asyncio.create_task(e.generate(_request("low", (4,), priority=-3)))
            await _queued(server, 2)
            high = asyncio.create_task(e.generate(_request("high", (5,), priority=5)))
            await _queued(server, 3)
            order = await _finish_order(server)
            await asyncio.gather(running, low, high)
            return order, sent

    order, sent = asyncio.run(main())
    assert order == [wire_rid("run"), wire_rid("high"), wire_rid("low")]
    priorities = {body["rid"]: body["priority"] for path, body in sent if path == "/generate"}
    assert priorities == {"3:run": 0, "3:low": -3, "4:high": 5}


def test_abort_by_id_returns_the_partial_to_the_waiting_generate_and_no_other() -> None:
    async def main() -> tuple[EngineOutput, EngineOutput, bool]:
        async with FakeSGLangServer(MANUAL) as server, SGLangServerEngine(url=server.url) as e:
            one = asyncio.create_task(e.generate(_request("a", max_new_tokens=50)))
            await _queued(server, 1)
            other = asyncio.create_task(e.generate(_request("ab", max_new_tokens=50)))
            await _queued(server, 2)
            await server.step(3)
            await e.abort("a")  # SGLang would abort "ab" too: it matches rid prefixes
            await server.step()
            partial = await one
            still_running = [req.rid for req in server.scheduler.running] == [wire_rid("ab")]
            await e.abort_all()
            await server.step()
            return partial, await other, still_running

    partial, other, still_running = asyncio.run(main())
    assert partial.aborted and still_running
    tokens, logprobs = _expected((1, 2, 3), 4)
    assert partial.token_ids == tuple(tokens) and partial.logprobs == tuple(logprobs)
    assert partial.versions == (VersionSpan("default", 0, 4),)
    assert other.aborted and len(other.token_ids) == 5  # 3, one while "a" ended, one more


def test_a_request_aborted_while_waiting_has_no_tokens_and_no_spans() -> None:
    async def main() -> EngineOutput:
        async with FakeSGLangServer(MANUAL) as server, SGLangServerEngine(url=server.url) as e:
            pending = asyncio.create_task(e.generate(_request()))
            await _queued(server, 1)
            await e.abort("a")
            return await pending

    out = asyncio.run(main())
    assert out.aborted and out.token_ids == () and out.logprobs == () and out.versions == ()


def test_set_weight_version_labels_later_tokens_without_aborting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> tuple[EngineOutput, list[tuple[str, Any]]]:
        async with FakeSGLangServer(MANUAL) as server, SGLangServerEngine(url=server.url) as e:
            pending = asyncio.create_task(e.generate(_request(max_new_tokens=6)))
            await _queued(server, 1)
            await server.step(2)
            sent = _spy(e, monkeypatch)
            await e.set_weight_version("7")
            await server.step(4)
            return await pending, sent

    out, sent = asyncio.run(main())
    assert sent == [("/update_weight_version", {"new_version": "7", "abort_all_requests": False})]
    assert out.finish == "length" and len(out.token_ids) == 6
    assert out.versions == (VersionSpan("default", 0, 2), VersionSpan("7", 2, 6))
    assert out.token_versions() == ("default", "default", "7", "7", "7", "7")


@pytest.mark.parametrize(
    ("mode", "running", "waiting"), [("keep", ["1:a"], []), ("retract", [], ["1:a"])]
)
def test_keep_and_retract_hold_the_request_and_resume_finishes_it(
    mode: PauseMode, running: list[str], waiting: list[str]
) -> None:
    async def main() -> tuple[EngineOutput, tuple[Any, ...], int]:
        async with FakeSGLangServer(MANUAL) as server, SGLangServerEngine(url=server.url) as e:
            pending = asyncio.create_task(e.generate(_request(max_new_tokens=6)))
            await _queued(server, 1)
            await server.step(2)
            await e.pause(mode)
            scheduler = server.scheduler
            await server.step(3)  # paused: no tokens
            held = (
                [req.rid for req in scheduler.running],
                [req.rid for req in scheduler.waiting],
                [len(req.output) for req in (*scheduler.running, *scheduler.waiting)],
            )
            await e.resume()
            await server.step(6)
            out = await pending
            return out, held, (await e.load()).preemptions

    out, held, preemptions = asyncio.run(main())
    assert held == (running, waiting, [2])
    assert out.finish == "length" and out.token_ids == tuple(_expected((1, 2, 3), 6)[0])
    assert preemptions == (1 if mode == "retract" else 0)


def test_pause_abort_returns_partials_and_wait_is_refused() -> None:
    async def main() -> EngineOutput:
        async with FakeSGLangServer(MANUAL) as server, SGLangServerEngine(url=server.url) as e:
            with pytest.raises(ValueError, match=r"no pause mode 'wait'.*\['abort', 'keep', 'r"):
                await e.pause("wait")
            assert not server.scheduler.frontend_paused
            pending = asyncio.create_task(e.generate(_request(max_new_tokens=9)))
            await _queued(server, 1)
            await server.step(2)
            pause = asyncio.create_task(e.pause("abort"))  # returns once the abort landed
            await server.wait_until(lambda s: s.frontend_paused)
            await server.step()
            await pause
            out = await pending
            later = asyncio.create_task(e.generate(_request("b", max_new_tokens=1)))
            await server.wait_until(lambda s: wire_rid("b") in s.in_flight)
            assert not server.scheduler.waiting  # paused: it waits before the queue
            await e.resume()
            await _queued(server, 1)
            await server.step()
            assert (await later).finish == "length"
            return out

    out = asyncio.run(main())
    assert out.aborted and len(out.token_ids) == 3 and len(out.versions) == 1


def test_load_maps_v1_loads_and_counts_prompt_and_cached_tokens() -> None:
    config = FakeSGLangConfig(
        step_interval_s=None, max_running_requests=2, max_total_num_tokens=500
    )

    async def main() -> tuple[Any, ...]:
        async with FakeSGLangServer(config) as server, SGLangServerEngine(url=server.url) as e:
            prompts = [(1, 2, 3, 4), (5, 6), (1, 2, 3, 4)]
            tasks = []
            for index, prompt in enumerate(prompts):
                tasks.append(asyncio.create_task(e.generate(_request(str(index), prompt))))
                await _queued(server, index + 1)
            await server.step()
            busy, used = await e.load(), server.scheduler.num_used_tokens
            await server.step(12)
            outs = await asyncio.gather(*tasks)
            return busy, used, outs, await e.load()

    busy, used, outs, idle = asyncio.run(main())
    assert (busy.running, busy.waiting, busy.max_running) == (2, 1, 2)
    assert busy.kv_usage == pytest.approx(used / 500, abs=1e-4) and busy.kv_usage > 0
    assert busy.utilization == 1.0  # every running slot taken
    assert (idle.running, idle.waiting) == (0, 0)
    assert idle.prefix_query_tokens == 10 and idle.prefix_hit_tokens == outs[2].cached_tokens > 0


def test_load_sums_dp_ranks_and_refuses_an_empty_reply() -> None:
    engine = SGLangServerEngine(url="http://127.0.0.1:9")
    ranks = [
        LoadSnapshot(
            num_running_reqs=3, max_running_requests=4, max_total_num_tokens=100, token_usage=0.5
        ),
        LoadSnapshot(
            num_waiting_reqs=2, max_running_requests=4, max_total_num_tokens=300, token_usage=0.1
        ),
    ]
    load = engine._load(LoadsReply(loads=ranks))
    assert (load.running, load.waiting, load.max_running) == (3, 2, 8)
    assert load.kv_usage == pytest.approx((50 + 30) / 400)
    with pytest.raises(BackendError, match=r"sglang@127\.0\.0\.1:9.*no DP rank"):
        engine._load(LoadsReply(loads=[]))


_GOOD: dict[str, Any] = {
    "rid": "1:a",
    "text": "",
    "output_ids": (5, 6),
    "finish_reason": FinishReason(type="length"),
    "weight_versions": (WeightVersionSpan(version="0", start=0, end=2),),
    "output_token_logprobs": ((-0.5, 5), (-0.25, 6)),
}


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"finish_reason": FinishReason(type="eos")}, "unknown finish reason 'eos'"),
        ({"finish_reason": None}, "unknown finish reason None"),
        ({"rid": "1:b"}, "reply is for rid '1:b'"),
        ({"output_token_logprobs": None}, "no meta_info.output_token_logprobs"),
        ({"output_token_logprobs": ((-0.5, 5),)}, "for other tokens"),
        ({"output_token_logprobs": ((-0.5, 5), (None, 6))}, "null log-probability"),
        ({"weight_versions": None}, "no meta_info.weight_versions"),
        ({"weight_versions": (WeightVersionSpan(version="0", start=0, end=1),)}, "cover 1"),
    ],
)
def test_an_unreadable_reply_is_a_backend_error_naming_the_engine(
    change: dict[str, Any], error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main(reply: GenerateResult) -> EngineOutput:
        async with SGLangServerEngine(url="http://127.0.0.1:9") as engine:

            async def generate(request: object) -> GenerateResult:
                return reply

            monkeypatch.setattr(engine.client, "generate", generate)
            return await engine.generate(_request())

    assert asyncio.run(main(GenerateResult(**_GOOD))).token_versions() == ("0", "0")
    with pytest.raises(BackendError, match=f"engine sglang@127.0.0.1:9: request 'a'.*{error}"):
        asyncio.run(main(GenerateResult(**{**_GOOD, **change})))


def test_engine_setup_attaches_a_working_engine() -> None:
    async def main() -> tuple[EngineOutput, bool]:
        async with FakeSGLangServer() as server:
            setup = EngineSetup(kind="sglang", urls={"2": server.url}, generate_timeout_s=9.0)
            with pytest.raises(ValueError, match="no server for device 1"):
                setup.build(1)
            engine = setup.build(2)
            assert isinstance(engine, SGLangServerEngine) and isinstance(engine, Engine)
            await engine.start()
            try:
                assert await engine.health() and engine.client.config.generate_timeout_s == 9.0
                out = await engine.generate(_request())
            finally:
                await engine.aclose()
            return out, not server.scheduler.crashed  # an attached server keeps running

    out, alive = asyncio.run(main())
    assert out.finish == "length" and len(out.logprobs) == 5 and alive


def test_engine_setup_launch_maps_its_fields_onto_sglang_flags(tmp_path: pathlib.Path) -> None:
    setup = EngineSetup(
        kind="sglang",
        model="/models/tiny",
        python="/envs/sglang/bin/python",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        kv_blocks=100,
        omp_num_threads=2,
        extra_args=("--device", "cpu", "--page-size", "16"),
        env={"SGLANG_USE_CPU_ENGINE": "1"},
        log_dir=str(tmp_path),
        startup_timeout_s=30.0,
    )
    engine = setup.build(3)
    assert isinstance(engine, SGLangServerEngine) and engine.server is not None
    config = engine.server.config
    argv = launch_command(config, 31000)
    assert argv[:4] == ["/envs/sglang/bin/python", "-m", "sglang.launch_server", "--model-path"]
    flags = dict(itertools.pairwise(argv))
    assert flags["--dtype"] == "float32" and flags["--context-length"] == "512"
    assert flags["--max-running-requests"] == "4" and flags["--max-total-tokens"] == "1600"
    assert "--enable-priority-scheduling" in argv and "--enable-memory-saver" not in argv
    assert argv[-4:] == ["--device", "cpu", "--page-size", "16"]
    assert dict(config.env) == {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "2"}
    assert config.log_path == str(tmp_path / "device-3" / "sglang.log")
    assert config.startup_timeout_s == 30.0


def test_engine_setup_inprocess_mode_builds_vllm_in_the_worker_and_refuses_the_rest() -> None:
    setup = EngineSetup(kind="vllm", mode="inprocess", model="/models/tiny", max_num_seqs=3)
    engine = setup.build(2, cpus=(1,))
    assert isinstance(engine, VLLMInProcessEngine) and engine.name == "vllm-inprocess@2"
    assert engine.config.max_num_seqs == 3 and engine.config.cpus == (1,)
    assert isinstance(EngineSetup(model="/models/tiny").build(2), VLLMEngine)
    for wrong in (
        {"kind": "sglang", "model": "m"},
        {"urls": {"0": "http://127.0.0.1:1"}},
        {"model": "m", "python": "/envs/vllm/bin/python"},
    ):
        with pytest.raises(ValueError, match="mode='inprocess' runs vLLM inside the worker"):
            EngineSetup(mode="inprocess", **wrong)  # type: ignore[arg-type]


def test_a_launched_engine_starts_serves_and_stops_its_server(tmp_path: pathlib.Path) -> None:
    config = SGLangServerConfig(
        model_path="m",
        module="dynarl.testing.sglang_fake",
        admin_api_key="adm",
        health_poll_s=0.05,
        startup_timeout_s=60,
        log_path=str(tmp_path / "logs" / "sglang.log"),
    )

    async def main() -> tuple[int, EngineOutput]:
        async with SGLangServerEngine(server=config) as engine:
            assert engine.server is not None and engine.server.pid is not None
            await engine.set_weight_version("3")  # admin endpoints: the key reached it
            await engine.pause("keep")
            await engine.resume()
            return engine.server.pid, await engine.generate(_request())

    pid, out = asyncio.run(main())
    assert out.versions == (VersionSpan("3", 0, 5),)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert (tmp_path / "logs" / "sglang.log").is_file()


def _engine_request(item: GenerationRequest, request_id: str) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        token_ids=tuple(int(t) for t in unpack_tokens(item.token_ids)),
        max_new_tokens=item.max_new_tokens,
    )


def _sample(item: GenerationRequest, out: EngineOutput) -> Sample:
    """The rollout role's answer (``EngineRollout._sample``, the fields the runtime reads)."""
    context = [int(t) for t in unpack_tokens(item.token_ids)]
    return Sample(
        sample_id=item.sample_id,
        token_ids=pack_tokens(context + list(out.token_ids)),
        prompt_len=len(context),
        logprobs=pack_floats(out.logprobs),
        metadata={FINISH: out.finish},
    )


@settings(max_examples=12, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 200), min_size=1, max_size=6),
    max_new=st.integers(1, 12),
    abort_after=st.integers(1, 14),
)
def test_an_aborted_request_continued_elsewhere_by_the_runtime_equals_one_run(
    prompt: list[int], max_new: int, abort_after: int
) -> None:
    item = GenerationRequest(sample_id="s", token_ids=pack_tokens(prompt), max_new_tokens=max_new)

    async def main() -> tuple[EngineOutput, Sample, int]:
        async with FakeSGLangServer(MANUAL) as donor, FakeSGLangServer() as receiver:
            async with (
                SGLangServerEngine(url=donor.url) as first,
                SGLangServerEngine(url=receiver.url) as second,
            ):
                whole = await second.generate(_engine_request(item, "whole"))
                progress = Progress(original=item)
                pending = asyncio.create_task(first.generate(_engine_request(item, "s.0")))
                await _queued(donor, 1)
                await donor.step(abort_after)
                if not pending.done():
                    await first.abort("s.0")
                    await donor.step()
                final = progress.absorb(_sample(item, await pending))
                if final is None:
                    again = progress.next_request()
                    assert isinstance(again, GenerationRequest)
                    rest = await second.generate(_engine_request(again, "s.1"))
                    final = progress.absorb(_sample(again, rest))
                assert final is not None
                return whole, final, progress.resumed

    whole, final, resumed = asyncio.run(main())
    assert [int(t) for t in unpack_tokens(final.token_ids)] == prompt + list(whole.token_ids)
    assert final.prompt_len == len(prompt) and final.logprobs == pack_floats(whole.logprobs)
    assert final.metadata[FINISH] == whole.finish == "length"
    assert resumed == (1 if abort_after < max_new else 0)


def test_sys_executable_is_the_default_interpreter() -> None:
    engine = EngineSetup(kind="sglang", model="m").build(0)
    assert isinstance(engine, SGLangServerEngine) and engine.server is not None
    assert engine.server.config.python == sys.executable
    assert "--max-total-tokens" not in launch_command(engine.server.config, 1)


def test_a_score_reply_may_report_the_largest_token_sent_as_zero_and_nothing_else() -> None:
    """SGLang 0.5.23 reports the model's last token id (often EOS) as 0 in
    ``input_token_logprobs`` (it clips ``x < vocab_size - 1``), its log-prob the sent
    token's; any other difference is a reply for other tokens."""
    from dynarl.backends.sglang._server_engine import _mismatch

    eos = 383
    assert _mismatch([5, 7, 0, 9, 0], [5, 7, eos, 9, eos]) == ""
    assert _mismatch([5, 7, 9], [5, 7, 9]) == ""
    assert _mismatch([5, 0, 9], [5, 7, 9]) == "token 1 of 3 is 0, 7 was sent"
    assert _mismatch([5, 8, eos], [5, 7, eos]) == "token 1 of 3 is 8, 7 was sent"
    assert _mismatch([5, 7], [5, 7, 9]) == "2 tokens for 3 sent"
