"""The fake SGLang server against a real one: the same requests, the same answers where
dynarl's adapter reads them (``test_sglang_role.py`` runs the serving role's engine tests
on both).

Each test runs once per server: ``fake`` (:class:`dynarl.testing.FakeSGLangServer`, served
by ``python -m dynarl.testing.sglang_fake``; always) and ``real`` (``sglang.launch_server``
0.5.23 on the tiny random Llama, from the environment of ``tools/sglang_env.sh``; skipped,
with the reason, where there is no kernel wheel, the CPU lacks AVX-512 or the environment
is not built). Both are started once for the package, in processes of their own, with the
same flags (``sglang_support.server_config``: CPU, two running requests, 4096 KV tokens,
priority scheduling). ``DYNARL_SGLANG_VENV`` names another environment;
``DYNARL_SGLANG_ENV_FORCE=1`` lifts the CPU check (for a kernel built without AVX-512).

**Conformance.** A scenario sends raw HTTP and reduces the replies to an *observation*: only
what the adapter (``dynarl/backends/sglang``: ``_client.py``, ``_http_wire.py``,
``_server_engine.py``) reads, made independent of the model (token ids become "is a prefix
of", "covers the output"). Each server's observation must equal one expectation, the real
server's documented behaviour; so the fake and the real server agree wherever a test
passes on both. Compared:

- status codes: ``/generate``, ``/abort_request``, ``/pause_generation``,
  ``/continue_generation``, ``/v1/loads``, ``/flush_cache`` (200 or 400), the weight-update
  group endpoints (200 or 400), and the 400s of malformed bodies;
- ``/generate`` reply: ``output_ids``, ``text`` (a string), ``meta_info``'s ``id`` (the rid
  echoed), ``finish_reason`` (``type``, ``length``; ``message`` of an abort: ``"Aborted"``,
  ``"Abort in waiting queue"``), ``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens`` (0, then all but the last prompt token), ``weight_version``,
  ``weight_versions`` (spans covering the output; one empty span for an empty output),
  ``num_retractions``, ``output_token_logprobs`` (``[logprob <= 0, token id, null]`` per
  output token) and ``e2e_latency`` (present);
- behaviours: greedy output repeats; ``priority`` is accepted; an aborted request's partial
  output (abort by rid, in the waiting queue, abort all, pause ``abort``) is a prefix of
  the full run; a request not in flight aborts as a no-op; each pause mode holds or ends
  what runs, holds new requests until ``/continue_generation``; the held requests then
  finish;
- ``/v1/loads``: one rank; ``num_running_reqs``, ``num_waiting_reqs``,
  ``max_running_requests``, ``max_total_num_tokens``, ``token_usage`` (> 0 when busy),
  ``accelerator`` (null), idle, busy and paused (a paused engine runs no iteration and
  reports the last one's figures); an unknown ``include`` section (500);
- prompt log-probs (scoring): ``logprob_start_len: 0`` gives ``input_token_logprobs``, one
  ``[logprob, token id, null]`` per prompt token, the first one's log-prob null and the rest
  ``<= 0``; the prefix cache is not used (``cached_tokens`` 0 on a repeated prompt); the
  output token and its log-prob are a plain generation's (within 1e-4); a start past the
  prompt is refused (400);
- ``/flush_cache``: 200 idle, 400 while a request runs or is frozen in place;
- weight updates: ``/init_weights_update_group`` (gloo, this process is the trainer's
  rank 0), ``/update_weights_from_distributed`` refused outside ``/begin_weight_update`` …
  ``/end_weight_update`` (400, ``success: false``, the message says so), accepted inside
  with the broadcast, ``/end_weight_update`` without a session refused, the group destroyed;
  ``success`` of each;
- error shapes (the adapter reads only the status, and shows the body): a validation error
  ``{"object": "error", "code": 400, ...}``, the ``/generate`` contract gate's
  ``{"error": "unknown field ..."}`` and the tokenizer manager's
  ``{"error": {"message": ...}}``.

A real server stays warm across tests; where it can finish a request before the test acts
on it, the test tries again, a bounded number of times. Nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from vllm_support import prompt

from dynarl.backends.sglang import (
    close_update_group,
    open_update_group,
    plan_weight_sync,
)
from dynarl.backends.sglang._buckets import flatten_bucket
from dynarl.backends.sglang._server_launcher import free_port
from dynarl.backends.sglang._weight_sync import broadcast_bucket

from .sglang_support import MAX_RUNNING, missing_sglang
from .sglang_targets import (
    ATTEMPTS,
    LOGPROB_TOL,
    LONG,
    NORM,
    SETTLE_S,
    Http,
    Target,
    aborted,
    body,
    in_flight,
    is_prefix_of_full_run,
    logprobs_ok,
    partial_view,
    run_http,
    spans,
)

# ---------------------------------------------------------------------- conformance


def test_generate_with_priority_and_rid(target: Target) -> None:
    async def scenario(http: Http) -> dict[str, Any]:
        assert (await http.post("/flush_cache"))[0] == 200
        version = await http.version()
        first_status, first = await http.post("/generate", body("c-1", 8, 101, priority=0))
        second_status, second = await http.post("/generate", body("c-2", 8, 101, priority=3))
        meta = first["meta_info"]
        fields = {
            "id",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "weight_version",
            "weight_versions",
            "num_retractions",
            "output_token_logprobs",
            "e2e_latency",
        }
        return {
            "status": (first_status, second_status),
            "meta_fields_missing": sorted(fields - set(meta)),
            "ids": (meta["id"], second["meta_info"]["id"]),
            "finish_reason": meta["finish_reason"],
            "counts": (len(first["output_ids"]), meta["completion_tokens"], meta["prompt_tokens"]),
            "cached_tokens": (meta["cached_tokens"], second["meta_info"]["cached_tokens"]),
            "logprobs_ok": logprobs_ok(first) and logprobs_ok(second),
            "spans": spans(first, version),
            "weight_version": meta["weight_version"] == version,
            "num_retractions": meta["num_retractions"],
            "text_is_str": isinstance(first["text"], str),
            "repeats": first["output_ids"] == second["output_ids"]
            and meta["output_token_logprobs"] == second["meta_info"]["output_token_logprobs"],
        }

    assert run_http(target, scenario) == {
        "status": (200, 200),
        "meta_fields_missing": [],
        "ids": ("c-1", "c-2"),
        "finish_reason": {"type": "length", "length": 8},
        "counts": (8, 8, 12),
        "cached_tokens": (0, 11),  # page size 1: every prompt token but the last
        "logprobs_ok": True,
        "spans": [("<current>", 0, 8)],
        "weight_version": True,
        "num_retractions": 0,
        "text_is_str": True,
        "repeats": True,
    }


def test_abort_by_rid(target: Target) -> None:
    async def scenario(http: Http) -> dict[str, Any]:
        version = await http.version()
        for attempt in range(ATTEMPTS):
            rid = f"cut-{attempt}"
            task = asyncio.ensure_future(http.post("/generate", body(rid, LONG, 102)))
            await http.wait_load(lambda load: load["num_running_reqs"] >= 1, "running")
            await asyncio.sleep(SETTLE_S)
            abort_reply = await http.post("/abort_request", {"rid": rid})
            status, reply = await task
            if aborted(reply):
                break
        else:
            pytest.fail("every request finished before the abort reached the server")
        return {
            "abort_reply": abort_reply,
            "status": status,
            **partial_view(reply, version),
            "prefix_of_full_run": await is_prefix_of_full_run(http, reply, 102),
            "unknown_rid": await http.post("/abort_request", {"rid": "no-such-request"}),
        }

    assert run_http(target, scenario) == {
        "abort_reply": (200, None),
        "status": 200,
        "finish": ("abort", "Aborted"),
        "partial": True,
        "completion_tokens_agree": True,
        "logprobs_ok": True,
        "spans": True,
        "prefix_of_full_run": True,
        "unknown_rid": (200, None),
    }


def test_abort_in_the_waiting_queue_and_abort_all(target: Target) -> None:
    async def scenario(http: Http) -> dict[str, Any]:
        version = await http.version()
        for attempt in range(ATTEMPTS):
            tasks = []
            for i in range(MAX_RUNNING + 1):
                rid = f"all-{attempt}-{i}"
                tasks.append(
                    asyncio.ensure_future(http.post("/generate", body(rid, LONG, 110 + i)))
                )
                await http.wait_load(in_flight(i + 1), f"{i + 1} requests in")
            load = await http.load()
            await asyncio.sleep(SETTLE_S)
            waiting_abort = await http.post("/abort_request", {"rid": f"all-{attempt}-2"})
            waiting_status, waiting = await tasks[-1]
            all_reply = await http.post("/abort_request", {"abort_all": True})
            running = await asyncio.gather(*tasks[:-1])
            if all(aborted(reply) for _, reply in running):
                break
        else:
            pytest.fail("a running request always finished before the abort reached the server")
        meta = waiting["meta_info"]
        return {
            "queued": (load["num_running_reqs"], load["num_waiting_reqs"]),
            "abort_replies": (waiting_abort, all_reply),
            "waiting": (
                waiting_status,
                meta["finish_reason"]["type"],
                meta["finish_reason"].get("message"),
                waiting["output_ids"],
                spans(waiting, version),
            ),
            "running": [(status, partial_view(reply, version)) for status, reply in running],
            "prefixes": [
                await is_prefix_of_full_run(http, reply, 110 + i)
                for i, (_, reply) in enumerate(running)
            ],
        }

    partial = {
        "finish": ("abort", "Aborted"),
        "partial": True,
        "completion_tokens_agree": True,
        "logprobs_ok": True,
        "spans": True,
    }
    assert run_http(target, scenario) == {
        "queued": (MAX_RUNNING, 1),
        "abort_replies": ((200, None), (200, None)),
        # An empty output has one empty span.
        "waiting": (200, "abort", "Abort in waiting queue", [], [("<current>", 0, 0)]),
        "running": [(200, partial)] * MAX_RUNNING,
        "prefixes": [True] * MAX_RUNNING,
    }


async def _pause_scenario(http: Http, mode: str) -> dict[str, Any]:
    for attempt in range(ATTEMPTS):
        long = asyncio.ensure_future(http.post("/generate", body(f"p-{mode}-{attempt}", LONG, 120)))
        await http.wait_load(lambda load: load["num_running_reqs"] >= 1, "running")
        await asyncio.sleep(SETTLE_S)
        pause_reply = await http.post("/pause_generation", {"mode": mode})
        if mode == "abort":
            status, reply = await long
            if aborted(reply):
                break
        else:
            await asyncio.sleep(SETTLE_S)
            if not long.done():
                break
            await http.post("/continue_generation", {})
    else:
        pytest.fail("every request finished before the pause reached the server")
    late = asyncio.ensure_future(http.post("/generate", body(f"late-{mode}", 4, 121)))
    await asyncio.sleep(SETTLE_S)
    paused_load = await http.load()
    held = (not long.done(), not late.done())
    flush_status = (await http.post("/flush_cache"))[0]
    continue_status, continue_body = await http.post("/continue_generation", {})
    (status, reply), (late_status, late_reply) = await long, await late
    meta = reply["meta_info"]
    return {
        "pause_reply": pause_reply,
        "held_while_paused": held,
        "load_while_paused": (paused_load["num_running_reqs"], paused_load["num_waiting_reqs"]),
        "flush_while_paused": flush_status,
        "continue_reply": (continue_status, continue_body.get("status")),
        "long": (status, meta["finish_reason"]["type"], len(reply["output_ids"]) == LONG),
        "retracted": meta["num_retractions"] > 0,
        "late": (late_status, late_reply["meta_info"]["finish_reason"]["type"]),
    }


@pytest.mark.parametrize(
    ("mode", "held", "load", "flush", "long", "retracted"),
    [
        # Abort ends what runs; the late request waits before the scheduler.
        ("abort", (False, True), (0, 0), 200, ("abort", False), False),
        # Retract moves what runs back to the waiting queue, its KV freed: a paused
        # engine with only waiting requests counts as idle, so the cache can be flushed.
        # /v1/loads still shows the last iteration's figures (no iteration runs).
        ("retract", (True, True), (1, 0), 200, ("length", True), True),
        # In place freezes what runs with its KV (no flush).
        ("in_place", (True, True), (1, 0), 400, ("length", True), False),
    ],
)
def test_each_pause_mode_then_continue(
    request: pytest.FixtureRequest,
    target: Target,
    mode: str,
    held: tuple[bool, bool],
    load: tuple[int, int],
    flush: int,
    long: tuple[str, bool],
    retracted: bool,
) -> None:
    assert run_http(target, lambda http: _pause_scenario(http, mode)) == {
        "pause_reply": (200, {"message": "Generation paused successfully.", "status": "ok"}),
        "held_while_paused": held,
        "load_while_paused": load,
        "flush_while_paused": flush,
        "continue_reply": (200, "ok"),
        "long": (200, *long),
        "retracted": retracted,
        "late": (200, "length"),
    }


def test_v1_loads(target: Target) -> None:
    keys = (
        "num_running_reqs",
        "num_waiting_reqs",
        "max_running_requests",
        "max_total_num_tokens",
        "token_usage",
    )

    async def scenario(http: Http) -> dict[str, Any]:
        status, reply = await http.get("/v1/loads", params={"include": "core"})
        idle = reply["loads"][0]
        tasks = []
        for i in range(MAX_RUNNING + 1):
            tasks.append(
                asyncio.ensure_future(http.post("/generate", body(f"l-{i}", LONG, 130 + i)))
            )
            await http.wait_load(in_flight(i + 1), f"{i + 1} requests in")
        busy = await http.load()
        await http.post("/abort_request", {"abort_all": True})
        await asyncio.gather(*tasks)
        bad_status, _ = await http.get("/v1/loads", params={"include": "everything"})
        return {
            "status": status,
            "top": (len(reply["loads"]), reply["accelerator"]),
            "types": {key: type(idle[key]).__name__ for key in keys},
            "idle": tuple(idle[key] for key in keys[:4]),
            "busy": (busy["num_running_reqs"], busy["num_waiting_reqs"], busy["token_usage"] > 0),
            "bad_include": bad_status,
        }

    assert run_http(target, scenario) == {
        "status": 200,
        "top": (1, None),
        "types": dict.fromkeys(keys[:4], "int") | {"token_usage": "float"},
        "idle": (0, 0, MAX_RUNNING, 4096),
        "busy": (MAX_RUNNING, 1, True),
        "bad_include": 500,  # SGLang's handler turns its own 400 into a bare 500
    }


def test_prompt_logprobs(target: Target) -> None:
    async def scenario(http: Http) -> dict[str, Any]:
        plain_status, plain = await http.post("/generate", body("p-0", 1, 150))
        statuses, replies = [], []
        for rid in ("p-1", "p-2"):
            status, reply = await http.post("/generate", body(rid, 1, 150, logprob_start_len=0))
            statuses.append(status)
            replies.append(reply)
        past_status, _ = await http.post("/generate", body("p-3", 1, 150, logprob_start_len=13))
        entries = replies[1]["meta_info"].get("input_token_logprobs") or []
        out = replies[1]["meta_info"]["output_token_logprobs"]
        ref = plain["meta_info"]["output_token_logprobs"]
        return {
            "status": (plain_status, *statuses, past_status),
            "tokens": [token for _, token, _ in entries] == prompt(12, 150),
            "first_null": bool(entries) and entries[0][0] is None,
            "rest_ok": all(isinstance(lp, float) and lp <= 0 for lp, _, _ in entries[1:]),
            "texts_null": all(text is None for _, _, text in entries),
            "repeats": replies[0]["meta_info"]["input_token_logprobs"] == entries,
            "cached": replies[1]["meta_info"]["cached_tokens"],
            "output_agrees": [token for _, token, _ in out] == [token for _, token, _ in ref]
            and all(abs(a[0] - b[0]) <= LOGPROB_TOL for a, b in zip(out, ref, strict=True)),
        }

    assert run_http(target, scenario) == {
        "status": (200, 200, 200, 400),
        "tokens": True,
        "first_null": True,
        "rest_ok": True,
        "texts_null": True,
        "repeats": True,
        "cached": 0,
        "output_agrees": True,
    }


def test_flush_cache(target: Target) -> None:
    async def scenario(http: Http) -> dict[str, Any]:
        idle_status, idle_text = await http.post("/flush_cache")
        task = asyncio.ensure_future(http.post("/generate", body("f-1", LONG, 140)))
        await http.wait_load(lambda load: load["num_running_reqs"] >= 1, "running")
        busy_status, _ = await http.post("/flush_cache")
        await http.post("/abort_request", {"abort_all": True})
        await task
        return {
            "idle": (idle_status, str(idle_text).startswith("Cache flushed")),
            "busy": busy_status,
        }

    assert run_http(target, scenario) == {"idle": (200, True), "busy": 400}


def test_weight_update_group_and_session(target: Target) -> None:
    tensors = {NORM: target.norm.to(torch.float32)}
    plan = plan_weight_sync(tensors, engine_tp_sizes=[1], max_bucket_bytes=1 << 20)
    (bucket,) = plan.buckets
    update = {
        "names": list(bucket.names),
        "dtypes": list(bucket.dtypes),
        "shapes": [list(shape) for shape in bucket.shapes],
        "load_format": "flattened_bucket",
    }

    def outcome(reply: tuple[int, Any]) -> tuple[int, bool]:
        return reply[0], bool(reply[1]["success"])

    async def scenario(http: Http) -> dict[str, Any]:
        port = free_port()
        joined, init = await asyncio.gather(
            asyncio.to_thread(
                open_update_group,
                master_address="127.0.0.1",
                master_port=port,
                rank=0,
                world_size=2,
                group_name="weight_update_group",
                backend="gloo",
                timeout_s=60.0,
            ),
            http.post(
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "backend": "gloo",
                },
            ),
        )
        try:
            outside = await http.post("/update_weights_from_distributed", update)
            begin = await http.post("/begin_weight_update", {})
            _, inside = await asyncio.gather(
                broadcast_bucket(joined, flatten_bucket(bucket, tensors), 60.0),
                http.post("/update_weights_from_distributed", update),
            )
            end = await http.post("/end_weight_update", {})
            end_again = await http.post("/end_weight_update", {})
            destroy = await http.post("/destroy_weights_update_group", {})
        finally:
            await asyncio.to_thread(close_update_group, joined)
        message = str(outside[1]["message"])
        return {
            "init": outcome(init),
            "outside_session": (
                *outcome(outside),
                "begin_weight_update() and end_weight_update()" in message,
            ),
            "begin": outcome(begin),
            "inside_session": outcome(inside),
            "end": outcome(end),
            "end_without_session": outcome(end_again),
            "destroy": outcome(destroy),
            "serves": (await http.post("/generate", body("w-1", 2, 150)))[0],
        }

    assert run_http(target, scenario) == {
        "init": (200, True),
        "outside_session": (400, False, True),
        "begin": (200, True),
        "inside_session": (200, True),
        "end": (200, True),
        "end_without_session": (400, False),
        "destroy": (200, True),
        "serves": 200,
    }


MALFORMED: list[tuple[str, str, bytes, tuple[int, str]]] = [
    # The /generate contract gate: unknown keys inside sampling_params.
    (
        "generate-unknown-sampling-key",
        "/generate",
        b'{"input_ids": [1, 2], "sampling_params": {"max_new_token": 3}}',
        (400, "error-string"),
    ),
    # Body validation (FastAPI/pydantic): a value of the wrong type.
    ("generate-bad-type", "/generate", b'{"input_ids": [1, 2], "rid": 5}', (400, "validation")),
    # The tokenizer manager: no prompt at all.
    ("generate-no-prompt", "/generate", b'{"sampling_params": {}}', (400, "error-object")),
    ("pause-bad-mode", "/pause_generation", b'{"mode": "sideways"}', (400, "validation")),
    ("abort-bad-rid", "/abort_request", b'{"rid": 5}', (400, "validation")),
    ("init-group-missing", "/init_weights_update_group", b"{}", (400, "validation")),
    ("weight-version-missing", "/update_weight_version", b"{}", (400, "validation")),
]


def error_shape(reply: Any) -> str:
    """Which of SGLang's error bodies ``reply`` is."""
    if isinstance(reply, dict) and reply.get("object") == "error" and "message" in reply:
        return "validation"
    error = reply.get("error") if isinstance(reply, dict) else None
    if isinstance(error, str):
        return "error-string"
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return "error-object"
    return f"other: {reply!r}"[:200]


@pytest.mark.parametrize(
    ("path", "raw", "expected"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_bodies(target: Target, path: str, raw: bytes, expected: tuple[int, str]) -> None:
    async def scenario(http: Http) -> tuple[int, str]:
        status, reply = await http.post(path, raw=raw)
        return status, error_shape(reply)

    assert run_http(target, scenario) == expected


def test_the_real_server_is_checked_or_skipped_with_a_reason() -> None:
    """Where no real server can run, its half is skipped with the reason this gives."""
    reason = missing_sglang()
    assert reason is None or reason.startswith(
        ("no sgl-kernel CPU wheel", "this CPU lacks avx512f", "the SGLang environment")
    )
