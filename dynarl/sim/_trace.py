"""The trace: every iteration's prompts, output lengths, turns and tool latencies, seeded.

Every policy is compared on the same trace: :func:`build_trace` draws iteration ``i``
from ``numpy.random.default_rng([seed, i])``, so it does not depend on what was drawn
before or on the policy. Lengths are log-normal (the heavy tail of reasoning outputs),
clipped so a sequence never exceeds the batch's ``max_seq_len``. Agentic episodes have a
geometric number of tool calls (skewed), turn outputs that shrink with the turn index
(round 0 longest), log-normal tool latencies capped at the timeout and log-normal
observation lengths. :func:`agentic_trace` draws the same from the specs alone (for a trace
replayed on a real engine without a whole workload) and, given a ``tool_success_rate``
below 1, each tool call's outcome, from a stream of its own so that the other draws do not
depend on it. Pure: arrays in, arrays out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dynarl.sim._specs import AgenticSpec, BatchSpec, LengthSpec
from dynarl.sim._workload_file import Workload

__all__ = ["IterationTrace", "agentic_trace", "build_trace"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class IterationTrace:
    """One iteration's samples (math: sequences; agentic: episodes), turns in CSR form."""

    iteration: int
    """Iteration index."""
    prompt: IntArray
    """Prompt tokens of each sample (a group shares its prompt)."""
    group: IntArray
    """Group (prompt) of each sample."""
    turn_start: IntArray
    """Sample ``s`` has turns ``turn_start[s]:turn_start[s + 1]``."""
    output: IntArray
    """Output tokens of each turn."""
    tool_latency: FloatArray
    """Tool latency after each turn, seconds (0 after the last turn)."""
    observation: IntArray
    """Tokens the tool result adds after each turn (0 after the last turn)."""
    tool_ok: npt.NDArray[np.bool_] | None = None
    """Whether the tool call after each turn succeeded (True after the last turn; None:
    every call did)."""

    @property
    def num_samples(self) -> int:
        """Samples in the iteration."""
        return int(self.prompt.shape[0])

    @property
    def num_turns(self) -> IntArray:
        """Turns of each sample."""
        return np.diff(self.turn_start)

    @property
    def total_tokens(self) -> IntArray:
        """Tokens of each finished sample (prompt, outputs, observations): trainer work."""
        per_turn = self.output + self.observation
        sums = np.add.reduceat(per_turn, self.turn_start[:-1]) if per_turn.size else per_turn
        return self.prompt + sums

    @property
    def output_tokens(self) -> IntArray:
        """Generated tokens of each sample."""
        return np.add.reduceat(self.output, self.turn_start[:-1])


def _lognormal(
    rng: np.random.Generator, median: FloatArray | float, sigma: float, size: int
) -> FloatArray:
    return np.asarray(np.exp(np.log(median) + sigma * rng.standard_normal(size)))


def build_trace(workload: Workload, iteration: int) -> IterationTrace:
    """Iteration ``iteration`` of ``workload``'s trace (deterministic in seed and index)."""
    return agentic_trace(
        seed=workload.seed,
        batch=workload.batch,
        lengths=workload.lengths,
        agentic=workload.agentic,
        iteration=iteration,
    )


def agentic_trace(
    *,
    seed: int,
    batch: BatchSpec,
    lengths: LengthSpec,
    agentic: AgenticSpec | None,
    iteration: int = 0,
    tool_success_rate: float = 1.0,
) -> IterationTrace:
    """Iteration ``iteration`` of the trace these specs draw (single turn without
    ``agentic``); deterministic in ``seed`` and ``iteration``. Each tool call succeeds with
    probability ``tool_success_rate`` (1: every call, and ``tool_ok`` is None). Raises
    ValueError for a rate outside [0, 1]."""
    if not 0.0 <= tool_success_rate <= 1.0:
        raise ValueError(f"tool_success_rate must be in [0, 1], got {tool_success_rate}")
    rng = np.random.default_rng([seed, iteration])
    n = batch.num_samples
    max_seq = batch.max_seq_len
    group = np.repeat(np.arange(batch.num_prompts, dtype=np.int64), batch.group_size)
    prompts = _lognormal(rng, lengths.prompt_median, lengths.prompt_sigma, batch.num_prompts)
    prompt = np.clip(np.rint(prompts), 1, max_seq // 4).astype(np.int64)[group]
    spec = agentic
    if spec is None:
        out = _lognormal(rng, lengths.output_median, lengths.output_sigma, n)
        output = np.clip(np.rint(out), 1, max_seq - prompt).astype(np.int64)
        zeros = np.zeros(n, dtype=np.int64)
        return IterationTrace(
            iteration=iteration,
            prompt=prompt,
            group=group,
            turn_start=np.arange(n + 1, dtype=np.int64),
            output=output,
            tool_latency=np.zeros(n),
            observation=zeros,
        )
    p = 1.0 / (1.0 + spec.mean_tool_calls)
    calls = np.minimum(rng.geometric(p, n) - 1, spec.max_tool_calls).astype(np.int64)
    turns = calls + 1
    start = np.concatenate([[0], np.cumsum(turns)]).astype(np.int64)
    total = int(start[-1])
    k = np.arange(total, dtype=np.int64) - np.repeat(start[:-1], turns)
    medians = lengths.output_median * spec.turn_decay ** k.astype(np.float64)
    output = np.maximum(np.rint(_lognormal(rng, medians, lengths.output_sigma, total)), 1)
    latency = _lognormal(rng, spec.tool_latency_median_s, spec.tool_latency_sigma, total)
    latency = np.minimum(latency, spec.tool_timeout_s)
    obs = np.maximum(
        np.rint(_lognormal(rng, spec.observation_median, spec.observation_sigma, total)), 1
    )
    last = np.zeros(total, dtype=bool)
    last[start[1:] - 1] = True
    latency[last] = 0.0
    obs[last] = 0
    ok = None
    if tool_success_rate < 1.0:
        outcomes = np.random.default_rng([seed, iteration, 1]).random(total)
        ok = (outcomes < tool_success_rate) | last
    return _clip_episodes(
        iteration,
        prompt,
        group,
        start,
        output.astype(np.int64),
        latency,
        obs.astype(np.int64),
        max_seq,
        ok,
    )


def _clip_episodes(
    iteration: int,
    prompt: IntArray,
    group: IntArray,
    start: IntArray,
    output: IntArray,
    latency: FloatArray,
    obs: IntArray,
    max_seq: int,
    ok: npt.NDArray[np.bool_] | None = None,
) -> IterationTrace:
    """Cut every episode where its context would pass ``max_seq`` (that turn ends it)."""
    turns = np.diff(start)
    owner = np.repeat(np.arange(prompt.shape[0]), turns)
    growth = output + obs
    cum = np.cumsum(growth)
    base = np.repeat(cum[start[:-1]] - growth[start[:-1]], turns)
    after = prompt[owner] + cum - base  # context after each turn's observation
    over = (after - obs) > max_seq  # the turn's own output overflows
    over_obs = after > max_seq  # its observation would overflow the next turn
    bad = np.unique(owner[over | over_obs])
    if bad.size == 0:
        return IterationTrace(
            iteration=iteration,
            prompt=prompt,
            group=group,
            turn_start=start,
            output=output,
            tool_latency=latency,
            observation=obs,
            tool_ok=ok,
        )
    keep = np.ones(output.shape[0], dtype=bool)
    output, latency, obs = output.copy(), latency.copy(), obs.copy()
    ok = None if ok is None else ok.copy()
    for s in bad.tolist():
        context = int(prompt[s])
        for t in range(int(start[s]), int(start[s + 1])):
            room = max_seq - context
            if output[t] >= room or context + output[t] + obs[t] >= max_seq:
                output[t] = max(1, min(int(output[t]), room))
                latency[t], obs[t] = 0.0, 0
                if ok is not None:
                    ok[t] = True  # now the episode's last turn
                keep[t + 1 : int(start[s + 1])] = False
                break
            context += int(output[t] + obs[t])
    new_turns = np.bincount(owner[keep], minlength=prompt.shape[0])
    return IterationTrace(
        iteration=iteration,
        prompt=prompt,
        group=group,
        turn_start=np.concatenate([[0], np.cumsum(new_turns)]).astype(np.int64),
        output=output[keep],
        tool_latency=latency[keep],
        observation=obs[keep],
        tool_ok=None if ok is None else ok[keep],
    )
