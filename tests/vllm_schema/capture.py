"""Capture the raw replies of a real vLLM server that ``tests/unit/test_vllm_client.py``
decodes, so that the unit tests read what vLLM really sends without a server.

Starts one server with :class:`dynarl.backends.vllm.VLLMServer` (dev mode, token-id route)
on a model directory and writes, into ``--out``:

- ``generate.json``: a greedy 8-token ``/inference/v1/generate`` reply (request
  ``capture-greedy``, the 12-token prompt of ``PROMPT``);
- ``generate_aborted.json``: the reply a waiting caller got for a 300-token request
  (``capture-cut``) aborted after some tokens, and ``abort_requests.json``, the abort's own;
- ``metrics.txt``: ``/metrics`` while two requests run;
- ``score.json``: the reply to scoring ``PROMPT`` followed by its greedy continuation
  (request ``capture-score``, ``score_body``: ``prompt_logprobs=0``);
- ``is_paused.json``, ``reset_prefix_cache.json``, ``weight_info.json``: control replies.

Run from the repository root, with vLLM in another environment::

    .venv/bin/python tests/vllm_schema/capture.py --python ENGINE_PYTHON --model DIR \\
        --out tests/vllm_schema
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import aiohttp

from dynarl.backends.vllm import GenerateRequest, SamplingParams, VLLMServer, VLLMServerConfig
from dynarl.backends.vllm._wire import engine_request_id, request_body, score_body

PROMPT = [197, 215, 20, 132, 261, 248, 207, 155, 244, 183, 298, 111]


def _request(request_id: str, max_tokens: int) -> dict[str, object]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return request_body(
        GenerateRequest(request_id=request_id, token_ids=PROMPT, sampling_params=sampling)
    )


async def _capture(url: str, out: Path) -> None:
    async with aiohttp.ClientSession(base_url=url) as http:

        async def post(path: str, body: object = None, name: str | None = None) -> bytes:
            async with http.post(path, json=body) as reply:
                data = await reply.read()
            if name:
                (out / name).write_bytes(data)
            return data

        async def get(path: str, name: str) -> bytes:
            async with http.get(path) as reply:
                data = await reply.read()
            (out / name).write_bytes(data)
            return data

        greedy = await post(
            "/inference/v1/generate", _request("capture-greedy", 8), "generate.json"
        )
        continuation = json.loads(greedy)["choices"][0]["token_ids"]
        scored = score_body("capture-score", PROMPT + continuation)
        await post("/inference/v1/generate", scored, "score.json")
        long = [
            asyncio.ensure_future(post("/inference/v1/generate", _request(f"capture-{n}", 300)))
            for n in ("cut", "other")
        ]
        while True:
            text = await get("/metrics", "metrics.txt")
            running = _value(text, b"vllm:num_requests_running{")
            if running >= 2 and _value(text, b"vllm:generation_tokens_total{") >= 48:
                break
            await asyncio.sleep(0.05)
        body = {"request_ids": [engine_request_id("capture-cut")]}
        await post("/abort_requests", body, "abort_requests.json")
        (out / "generate_aborted.json").write_bytes(await long[0])
        await long[1]
        await post("/pause?mode=keep")
        await get("/is_paused", "is_paused.json")
        await post("/resume")
        await post("/reset_prefix_cache", name="reset_prefix_cache.json")
        await get("/weight_info", "weight_info.json")


def _value(text: bytes, prefix: bytes) -> float:
    """The first sample of the metric that ``prefix`` starts (0 before it appears)."""
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].rsplit(b" ", 1)[1]) if lines else 0.0


async def _main(args: argparse.Namespace) -> None:
    config = VLLMServerConfig(
        model=args.model,
        python=args.python,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=2,
        cpu_kvcache_space_gib=1,
        cpu_omp_threads_bind="nobind",
        omp_num_threads=1,
        log_dir=args.log_dir,
    )
    async with VLLMServer(config) as server:
        await _capture(server.url, Path(args.out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="interpreter with vLLM")
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--out", required=True, help="directory for the captured replies")
    parser.add_argument("--log-dir", default=None, help="keep the server's log here")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
