"""A profiling pass on a real engine through a job, for the simulator's engine model (issue 20).

The engine is measured as the request policies drive it: every request goes through the
job's dispatcher and rollout role (``dynarl.demo._agent_replay.replay_trace``), with the
runtime's processes beside the engine on the same cores. Decode: ``b`` requests of ``L``
fresh prompt tokens run together to ``N1`` and, again with fresh prompts, to ``N2`` output
tokens (EOS ignored); the difference of the two wall times over ``N2 - N1`` is one decode
step of batch ``b`` holding on average ``b * (L + (N1 + N2) / 2)`` KV tokens (prefill and
dispatch cancel). Prefill: one request of ``P`` fresh tokens generating one token, minus
one of 16 tokens: the seconds ``P - 16`` tokens of prefill add; that one's wall time is the
round trip (submission to output) every turn pays. Every figure is the median
of ``repeats`` tries; fresh prompts never hit the prefix cache. The grid is a
:class:`Grid`: :data:`FULL` for the benchmark, :data:`QUICK` (the fewest points a profile
takes, far enough apart to measure the tiny model on a loaded CPU) for a smoke; its longest
prompt needs a ``max_model_len`` of 961 or more. Used by ``bench/priority.py``; not a
benchmark on its own.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

import numpy as np

from dynarl.demo._agent_replay import replay_trace
from dynarl.runtime import Job
from dynarl.sim import DecodePoint, EngineProfile, IterationTrace, PrefillPoint

__all__ = ["FULL", "QUICK", "Grid", "profile_engine"]

BASE_PROMPT = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class Grid:
    """The points a profiling pass measures."""

    batches: tuple[int, ...]
    """Decode batch sizes ``b``."""
    contexts: tuple[int, ...]
    """Decode prompt lengths ``L``."""
    outputs: tuple[int, int]
    """``(N1, N2)``: the short and the long run's output tokens."""
    prompts: tuple[int, ...]
    """Prefill prompt lengths ``P``."""
    repeats: int
    """Tries of every point (their median is kept)."""


FULL = Grid(batches=(1, 2, 4, 8), contexts=(128, 512), outputs=(8, 72),
            prompts=(128, 384, 768, 1280), repeats=3)  # fmt: skip
QUICK = Grid(batches=(1, 2), contexts=(16, 128), outputs=(2, 34), prompts=(64, 960), repeats=3)


def _single_turns(batch: int, prompt: int, output: int, iteration: int) -> IterationTrace:
    """``batch`` one-turn episodes of ``prompt`` tokens (each its own group) to ``output``."""
    return IterationTrace(
        iteration=iteration,
        prompt=np.full(batch, prompt, dtype=np.int64),
        group=np.arange(batch, dtype=np.int64),
        turn_start=np.arange(batch + 1, dtype=np.int64),
        output=np.full(batch, output, dtype=np.int64),
        tool_latency=np.zeros(batch),
        observation=np.zeros(batch, dtype=np.int64),
    )


async def profile_engine(
    job: Job, *, vocab: int, seed: int = 1000, grid: Grid = FULL
) -> EngineProfile:
    """Profile the engine behind ``job``'s rollout on ``grid`` (see the module docstring)."""
    runs = itertools.count(seed)

    async def seconds(batch: int, prompt: int, output: int) -> float:
        run = next(runs)  # a fresh iteration (sample ids) and seed (prompt tokens)
        trace = _single_turns(batch, prompt, output, run)
        return (await replay_trace(job, trace, vocab=vocab, seed=run)).wall_s

    await seconds(1, BASE_PROMPT, 4)  # warm-up
    decode, prefill, trips = [], [], []
    n1, n2 = grid.outputs
    for batch, length in itertools.product(grid.batches, grid.contexts):
        steps = []
        for _ in range(grid.repeats):
            short = await seconds(batch, length, n1)
            steps.append((await seconds(batch, length, n2) - short) / (n2 - n1))
        kv = batch * (length + (n1 + n2) / 2)
        decode.append(DecodePoint(batch=batch, kv_tokens=kv, step_s=statistics.median(steps)))
    for tokens in grid.prompts:
        extra = []
        for _ in range(grid.repeats):
            base = await seconds(1, BASE_PROMPT, 1)
            trips.append(base)
            extra.append(await seconds(1, tokens, 1) - base)
        prefill.append(PrefillPoint(tokens=tokens - BASE_PROMPT, seconds=statistics.median(extra)))
    return EngineProfile(
        decode=tuple(decode), prefill=tuple(prefill), round_trip_s=statistics.median(trips)
    )
