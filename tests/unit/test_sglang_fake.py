"""FakeSGLangServer behaves as SGLang 0.5.23 does at the HTTP boundary (raw HTTP here)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._server import FakeSGLangServer

Body = dict[str, Any]


async def _post(
    session: aiohttp.ClientSession, url: str, body: Body | None, key: str | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.post(url, json=body, headers=headers) as response:
        text = await response.text()
        try:
            return response.status, await response.json(content_type=None)
        except ValueError:
            return response.status, text


def _run(
    test: Callable[[FakeSGLangServer, aiohttp.ClientSession], Awaitable[None]],
    config: FakeSGLangConfig | None = None,
) -> None:
    async def main() -> None:
        async with FakeSGLangServer(config) as server, aiohttp.ClientSession() as session:
            await test(server, session)

    asyncio.run(main())


def _gen(rid: str, prompt: list[int], max_new: int = 4, **extra: Any) -> Body:
    return {
        "rid": rid,
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_new},
        **extra,
    }


MANUAL = FakeSGLangConfig(step_interval_s=None)


def test_unknown_top_level_fields_are_ignored_like_sglang() -> None:
    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        status, body = await _post(session, f"{server.url}/generate", _gen("a", [1, 2], no_such=1))
        assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "length"
        status, body = await _post(
            session, f"{server.url}/pause_generation", {"mode": "retract", "bogus": True}
        )
        assert (status, body["status"]) == (200, "ok")

    _run(test)


def test_unknown_sampling_params_are_refused_with_sglangs_text() -> None:
    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        request = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "beam": 3}}
        status, body = await _post(session, f"{server.url}/generate", request)
        assert status == 400
        assert body["error"].startswith("unknown field `beam`, expected one of `max_new_tokens`")
        request["sampling_params"] = {"max_new_tokens": "many"}
        status, body = await _post(session, f"{server.url}/generate", request)
        assert (status, body["error"]) == (400, 'invalid type: string "many", expected i64')
        # Lax body validation would take "5"; the contract gate on the raw JSON does not.
        request = {"input_ids": [1], "priority": "5"}
        status, body = await _post(session, f"{server.url}/generate", request)
        assert (status, body["error"]) == (400, 'invalid type: string "5", expected i64')
        request = {"input_ids": [1, 2.5]}
        status, body = await _post(session, f"{server.url}/generate", request)
        assert (status, body["error"]) == (400, "invalid type: floating point `2.5`, expected i64")

    _run(test)


def test_bad_types_and_missing_fields_are_validation_errors() -> None:
    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        status, body = await _post(session, f"{server.url}/pause_generation", {"mode": "nap"})
        assert status == 400 and body["object"] == "error" and body["code"] == 400
        status, body = await _post(
            session, f"{server.url}/init_weights_update_group", {"master_address": "x"}
        )
        assert status == 400 and body["type"] == "Bad Request"
        status, body = await _post(session, f"{server.url}/generate", {"sampling_params": {}})
        assert status == 400
        assert body == {
            "error": {"message": "Either text, input_ids or input_embeds should be provided."}
        }

    _run(test)


def test_admin_key_guards_admin_endpoints_only() -> None:
    config = FakeSGLangConfig(admin_api_key="adm")

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        status, body = await _post(session, f"{server.url}/pause_generation", {})
        assert (status, body) == (401, {"error": "Unauthorized"})
        status, _ = await _post(session, f"{server.url}/pause_generation", {}, key="wrong")
        assert status == 401
        status, _ = await _post(session, f"{server.url}/continue_generation", {}, key="adm")
        assert status == 200
        status, _ = await _post(session, f"{server.url}/generate", _gen("a", [1]))
        assert status == 200
        async with session.get(f"{server.url}/health") as response:
            assert response.status == 200

    _run(test, config)


def test_api_key_guards_normal_endpoints_and_admin_key_wins_on_admin_ones() -> None:
    config = FakeSGLangConfig(api_key="usr", admin_api_key="adm")

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        assert (await _post(session, f"{server.url}/generate", _gen("a", [1])))[0] == 401
        assert (await _post(session, f"{server.url}/generate", _gen("b", [1]), "usr"))[0] == 200
        assert (await _post(session, f"{server.url}/abort_request", {}, "usr"))[0] == 401
        assert (await _post(session, f"{server.url}/abort_request", {}, "adm"))[0] == 200

    _run(test, config)


def test_weight_updates_only_inside_a_session() -> None:
    update = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        status, body = await _post(session, f"{server.url}/update_weights_from_distributed", update)
        assert (status, body) == (
            400,
            {
                "success": False,
                "message": "update_weights_from_distributed must run between "
                "begin_weight_update() and end_weight_update()",
            },
        )
        status, body = await _post(session, f"{server.url}/end_weight_update", {})
        assert status == 400 and body["message"].startswith("no weight-update session is open")
        assert (await _post(session, f"{server.url}/begin_weight_update", {}))[0] == 200
        status, body = await _post(session, f"{server.url}/begin_weight_update", {})
        assert status == 400 and "already open" in body["message"]
        status, body = await _post(session, f"{server.url}/update_weights_from_distributed", update)
        assert status == 400 and body["message"].startswith("Failed to receive weights: Group")
        assert (await _post(session, f"{server.url}/end_weight_update", {}))[0] == 200

    _run(test)


async def _submit(session: aiohttp.ClientSession, url: str, body: Body) -> asyncio.Task[Any]:
    return asyncio.create_task(_post(session, f"{url}/generate", body))


@pytest.mark.parametrize(
    ("enabled", "low_first", "expected"),
    [
        (True, False, ["hi", "mid", "lo"]),
        (True, True, ["lo", "mid", "hi"]),
        (False, False, ["mid", "lo", "hi"]),
    ],
)
def test_priority_orders_admission(enabled: bool, low_first: bool, expected: list[str]) -> None:
    config = FakeSGLangConfig(
        step_interval_s=None,
        max_running_requests=1,
        enable_priority_scheduling=enabled,
        schedule_low_priority_values_first=low_first,
    )

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        scheduler = server.scheduler
        blocker = await _submit(session, server.url, _gen("first", [1], max_new=2))
        await server.wait_until(lambda s: len(s.waiting) == 1)
        await server.step()
        tasks = []
        for rid, priority in (("mid", 5), ("lo", 1), ("hi", 9)):
            tasks.append(await _submit(session, server.url, _gen(rid, [2], priority=priority)))
            queued = len(tasks)
            await server.wait_until(lambda s, n=queued: len(s.waiting) == n)
        order: list[str] = []
        while len(order) < 3:
            await server.step()
            order += [r.rid for r in scheduler.running if r.rid not in order]
        assert order == expected
        await server.step(10)
        await asyncio.gather(blocker, *tasks)

    _run(test, config)


def test_radix_cache_reports_cached_tokens_and_flush_resets_it() -> None:
    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        url = f"{server.url}/generate"
        _, first = await _post(session, url, _gen("a", [5, 6, 7, 8, 9], max_new=3))
        _, second = await _post(session, url, _gen("b", [5, 6, 7, 1], max_new=3))
        assert first["meta_info"]["cached_tokens"] == 0
        assert second["meta_info"]["cached_tokens"] == 3
        status, text = await _post(session, f"{server.url}/flush_cache", None)
        assert status == 200 and text.startswith("Cache flushed.")
        _, third = await _post(session, url, _gen("c", [5, 6, 7, 1], max_new=3))
        assert third["meta_info"]["cached_tokens"] == 0

    _run(test)


def test_token_usage_counts_running_tokens_and_frees_them_on_finish() -> None:
    config = FakeSGLangConfig(step_interval_s=None, max_total_num_tokens=100)

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        task = await _submit(session, server.url, _gen("a", list(range(10)), max_new=5))
        await server.wait_until(lambda s: len(s.waiting) == 1)
        await server.step(2)
        async with session.get(f"{server.url}/v1/loads") as response:
            load = (await response.json())["loads"][0]
        assert (load["num_running_reqs"], load["num_used_tokens"]) == (1, 12)
        assert load["token_usage"] == 0.12
        await server.step(3)
        await task
        async with session.get(f"{server.url}/v1/loads?include=core") as response:
            load = (await response.json())["loads"][0]
        assert (load["num_running_reqs"], load["num_used_tokens"], load["token_usage"]) == (0, 0, 0)
        assert "memory" not in load and "queues" not in load

    _run(test, config)


def test_abort_returns_partial_output_like_sglang() -> None:
    config = FakeSGLangConfig(step_interval_s=None, max_running_requests=1)

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        running = await _submit(session, server.url, _gen("run", [1, 2], max_new=50))
        waiting = await _submit(session, server.url, _gen("wait", [3], max_new=50))
        await server.wait_until(lambda s: len(s.waiting) == 2)
        await server.step(3)
        assert (await _post(session, f"{server.url}/abort_request", {"rid": "wait"}))[0] == 200
        status, body = await waiting
        assert status == 200 and body["output_ids"] == []
        assert body["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Abort in waiting queue",
        }
        assert "prompt_tokens" not in body["meta_info"]
        await _post(session, f"{server.url}/abort_request", {"rid": "run"})
        assert not running.done()
        await server.step()
        status, body = await running
        assert len(body["output_ids"]) == 4 and body["meta_info"]["prompt_tokens"] == 2
        assert body["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }

    _run(test, config)


def test_pause_retract_moves_running_requests_back_and_continue_finishes_them() -> None:
    config = FakeSGLangConfig(step_interval_s=None)

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        task = await _submit(session, server.url, _gen("a", [1, 2, 3], max_new=6))
        await server.wait_until(lambda s: len(s.waiting) == 1)
        await server.step(2)
        await _post(session, f"{server.url}/pause_generation", {"mode": "retract"})
        assert [r.rid for r in server.scheduler.waiting] == ["a"]
        assert not server.scheduler.running
        async with session.get(f"{server.url}/ready") as response:
            assert response.status == 503
        late = await _submit(session, server.url, _gen("late", [9], max_new=1))
        await server.step(3)
        assert [r.rid for r in server.scheduler.waiting] == ["a"]
        await _post(session, f"{server.url}/continue_generation", {})
        await server.wait_until(lambda s: len(s.waiting) == 2)
        await server.step(6)
        (_, body), (_, late_body) = await asyncio.gather(task, late)
        assert len(body["output_ids"]) == 6 and body["meta_info"]["num_retractions"] == 1
        assert late_body["meta_info"]["finish_reason"]["type"] == "length"

    _run(test, config)


def test_pause_in_place_keeps_requests_and_refuses_flush() -> None:
    config = FakeSGLangConfig(step_interval_s=None)

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        task = await _submit(session, server.url, _gen("a", [1], max_new=3))
        await server.wait_until(lambda s: len(s.waiting) == 1)
        await server.step()
        await _post(session, f"{server.url}/pause_generation", {"mode": "in_place"})
        status, text = await _post(session, f"{server.url}/flush_cache", None)
        assert (status, text) == (400, "Flush cache failed.\n")
        await server.step(5)
        assert [r.rid for r in server.scheduler.running] == ["a"]
        await _post(session, f"{server.url}/continue_generation", {})
        await server.step(2)
        assert len((await task)[1]["output_ids"]) == 3

    _run(test, config)


def test_release_memory_while_busy_kills_the_server_as_sglang_asserts() -> None:
    config = FakeSGLangConfig(step_interval_s=None)

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        task = await _submit(session, server.url, _gen("a", [1], max_new=3))
        await server.wait_until(lambda s: len(s.waiting) == 1)
        status, body = await _post(session, f"{server.url}/release_memory_occupation", {})
        assert status == 500 and "only when server is idle" in body["error"]["message"]
        assert (await task)[0] == 503
        async with session.get(f"{server.url}/health") as response:
            assert response.status == 503

    _run(test, config)


def test_release_and_resume_when_idle_and_resume_of_unreleased_tag_kills() -> None:
    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        url = server.url
        body = {"tags": ["kv_cache"]}
        assert await _post(session, f"{url}/release_memory_occupation", body) == (200, None)
        queued = await _submit(session, url, _gen("a", [1], max_new=1))
        await asyncio.sleep(0.02)
        assert not queued.done()
        assert await _post(session, f"{url}/resume_memory_occupation", body) == (200, None)
        assert (await queued)[0] == 200
        status, _ = await _post(session, f"{url}/resume_memory_occupation", {"tags": ["weights"]})
        assert status == 500 and server.scheduler.crashed

    _run(test)


def test_streaming_is_cumulative_and_ends_with_done() -> None:
    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        body = _gen("s", [4, 4], max_new=3, stream=True)
        async with session.post(f"{server.url}/generate", json=body) as response:
            lines = [line async for line in response.content if line.strip()]
        assert lines[-1].strip() == b"data: [DONE]"
        import json

        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3]
        assert chunks[-1]["output_ids"][:2] == chunks[1]["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"

    _run(test)


def test_duplicate_rid_and_context_length_are_refused_with_sglangs_messages() -> None:
    config = FakeSGLangConfig(step_interval_s=None, context_length=16)

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        first = await _submit(session, server.url, _gen("dup", [1], max_new=2))
        await server.wait_until(lambda s: "dup" in s.in_flight)
        status, body = await _post(session, f"{server.url}/generate", _gen("dup", [1]))
        assert (status, body) == (400, {"error": {"message": "Duplicate request ID detected: dup"}})
        status, body = await _post(session, f"{server.url}/generate", _gen("long", [1] * 10, 8))
        assert status == 400
        assert body["error"]["message"].startswith(
            "Requested token count exceeds the model's maximum context length of 16 tokens. "
            "You requested a total of 18 tokens"
        )
        await server.step(3)
        await first

    _run(test, config)


def test_priority_refused_when_disabled_and_abort_flag_set() -> None:
    config = FakeSGLangConfig(abort_on_priority_when_disabled=True)

    async def test(server: FakeSGLangServer, session: aiohttp.ClientSession) -> None:
        status, body = await _post(session, f"{server.url}/generate", _gen("p", [1], priority=3))
        assert status == 503 and body["code"] == 503
        assert body["message"].startswith("Using priority is disabled for this server.")

    _run(test, config)


def test_served_from_a_thread_for_synchronous_callers() -> None:
    import urllib.request

    with FakeSGLangServer.running_in_thread() as server:
        with urllib.request.urlopen(f"{server.url}/model_info", timeout=10) as response:
            assert response.status == 200
            assert b'"weight_version":"default"' in response.read()
