"""A profiling pass on a running vLLM server, for the simulator's engine model (issue 20).

Decode: ``b`` requests of ``L`` fresh prompt tokens each run together to ``N1`` and, again
with fresh prompts, to ``N2`` output tokens (EOS ignored); the difference of the two wall
times over ``N2 - N1`` is one decode step of batch ``b`` holding on average
``b * (L + (N1 + N2) / 2)`` KV tokens (the prefill and the HTTP round trip cancel). Prefill:
one request of ``P`` fresh tokens generating one token, minus one of 16 tokens: the seconds
``P - 16`` tokens of prefill add. Every figure is the median of ``REPEATS`` tries; the prefix
cache is reset before each. Used by ``bench/priority.py``; not a benchmark on its own.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time

from dynarl.backends.vllm import GenerateRequest, SamplingParams, VLLMClient, VLLMClientConfig
from dynarl.sim import DecodePoint, EngineProfile, PrefillPoint

__all__ = ["profile_engine"]

BATCHES = (1, 2, 4, 8)
CONTEXTS = (128, 512)
N1, N2 = 8, 72
PROMPTS = (128, 384, 768, 1280)
BASE_PROMPT = 16
REPEATS = 3


async def _run(
    client: VLLMClient, rng: random.Random, ids: itertools.count[int], batch: int, length: int,
    tokens: int, vocab: int,
) -> float:  # fmt: skip
    """Seconds ``batch`` concurrent requests of ``length`` fresh tokens take to ``tokens``."""
    await client.reset_prefix_cache()
    requests = [
        GenerateRequest(
            request_id=f"profile-{next(ids)}",
            token_ids=[rng.randrange(vocab) for _ in range(length)],
            sampling_params=SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0),
        )
        for _ in range(batch)
    ]
    began = time.perf_counter()
    await asyncio.gather(*(client.generate(r) for r in requests))
    return time.perf_counter() - began


async def profile_engine(url: str, *, vocab: int, seed: int = 0) -> EngineProfile:
    """Profile the vLLM server at ``url`` (see the module docstring)."""
    rng, ids = random.Random(seed), itertools.count()
    decode, prefill = [], []
    async with VLLMClient(VLLMClientConfig(base_url=url)) as client:
        await _run(client, rng, ids, 1, BASE_PROMPT, 4, vocab)  # warm-up
        for batch, length in itertools.product(BATCHES, CONTEXTS):
            steps = []
            for _ in range(REPEATS):
                short = await _run(client, rng, ids, batch, length, N1, vocab)
                long = await _run(client, rng, ids, batch, length, N2, vocab)
                steps.append((long - short) / (N2 - N1))
            kv = batch * (length + (N1 + N2) / 2)
            decode.append(DecodePoint(batch=batch, kv_tokens=kv, step_s=statistics.median(steps)))
        for tokens in PROMPTS:
            extra = []
            for _ in range(REPEATS):
                base = await _run(client, rng, ids, 1, BASE_PROMPT, 1, vocab)
                extra.append(await _run(client, rng, ids, 1, tokens, 1, vocab) - base)
            prefill.append(
                PrefillPoint(tokens=tokens - BASE_PROMPT, seconds=statistics.median(extra))
            )
    return EngineProfile(decode=tuple(decode), prefill=tuple(prefill))
