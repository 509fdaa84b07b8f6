"""A multi-turn agentic trace replayed on real engines through a job (request priority, issue 20).

Every episode of an :class:`~dynarl.sim.IterationTrace` is a chain of turns. Its first
prompt is its group's prompt (seeded token ids, the same for every episode of the group: a
shared prefix); each turn generates exactly ``trace.output[t]`` tokens (EOS ignored: a
random model makes no real tool calls); then the tool takes ``trace.tool_latency[t]``
seconds (environment time, a wait) and appends ``trace.observation[t]`` seeded tokens, and
the next turn's prompt is the whole context so far. The driver (:func:`replay_trace`)
submits each turn to the job's rollout component; the runtime's dispatcher holds the queue,
orders it by the component's request policy and admits up to ``max_inflight`` requests per
engine. Each turn carries what a policy keys on: ``tool_calls`` (turns the episode has
done), ``episode`` with ``affinity="prefer"`` (back to the engine that holds its prefix),
``attained_service`` (tokens the episode has generated), ``tool_ok`` (whether its last tool
call succeeded). As it goes it tells the scheduler what is left
(``Job.set_remaining``): the turns still to come. With ``score=``, each episode's whole
context goes, as the episode ends, to an inference component that scores it (a reference
model's log-probs), and the iteration ends with the last score; the scorer's remaining
work is the scores handed to it and not yet back.

:class:`ReplayReport` keeps, per turn, its prompt tokens, the part of them the engine had
computed before for this episode (the last turn's whole context: ``reusable``), the tokens
the engine found cached, and when it was submitted and finished; from them the iteration
time, the prefix hit rate and the re-prefilled tokens (reusable but not found cached). Pure
bookkeeping plus the driver; runs on the job's event loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from dynarl.bus import GenerationRequest, Sample, pack_tokens, unpack_tokens
from dynarl.errors import BackendError
from dynarl.runtime import Job
from dynarl.sim import IterationTrace

__all__ = ["ReplayReport", "TurnRecord", "replay_trace", "turn_tokens"]

_CACHED = "cached_tokens"


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnRecord:
    """One turn as the engine served it."""

    sample: int
    """The episode."""
    turn: int
    """Its index within the episode."""
    prompt_tokens: int
    """Tokens of its prompt (the context so far)."""
    reusable: int
    """Of those, tokens the engine computed for this episode before (0 for a first turn)."""
    cached_tokens: int
    """Tokens the engine found in its prefix cache."""
    output_tokens: int
    """Tokens it generated."""
    submitted_s: float
    """Seconds from the replay's start to the turn's submission."""
    finished_s: float
    """Seconds from the replay's start to its output."""
    device: int
    """The engine (device) that served it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayReport:
    """A replayed iteration."""

    wall_s: float
    """Seconds from the first submission to the last episode's end (its score, when the
    episodes were scored)."""
    turns: tuple[TurnRecord, ...]
    """Every turn, in the order they finished."""
    rollout_s: float = 0.0
    """Seconds from the first submission to the last turn's output (``wall_s`` unless the
    episodes were scored after it)."""
    score_spans: tuple[tuple[float, float], ...] = ()
    """Each scored episode's score: when it was handed to the scorer and when it came
    back, seconds from the replay's start (``replay_trace(score=...)``)."""

    @property
    def score_busy_s(self) -> float:
        """Seconds during which at least one score was outstanding."""
        busy, end = 0.0, float("-inf")
        for start, stop in sorted(self.score_spans):
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        return busy

    @property
    def hit_rate(self) -> float:
        """Cached tokens over prompt tokens, every turn."""
        prompts = sum(t.prompt_tokens for t in self.turns)
        return sum(t.cached_tokens for t in self.turns) / prompts if prompts else 0.0

    @property
    def reprefill_tokens(self) -> int:
        """Tokens computed again although the engine had computed them for the episode
        before (evicted, or never cached: vLLM caches whole 128-token blocks)."""
        return sum(max(0, t.reusable - t.cached_tokens) for t in self.turns)

    @property
    def waits_s(self) -> tuple[float, ...]:
        """Submission to output of every turn, seconds (queueing and serving)."""
        return tuple(t.finished_s - t.submitted_s for t in self.turns)


def turn_tokens(seed: int, kind: int, index: int, length: int, vocab: int) -> list[int]:
    """``length`` seeded token ids in ``[0, vocab)`` for prompt ``index`` (``kind`` 0) or the
    observation of turn ``index`` (``kind`` 1): the same in every run of the trace."""
    rng = np.random.default_rng([seed, kind, index])
    return [int(t) for t in rng.integers(0, vocab, size=length)]


async def replay_trace(
    job: Job,
    trace: IterationTrace,
    *,
    vocab: int,
    seed: int = 0,
    component: str = "rollout",
    score: str | None = None,
    timeout_s: float = 600.0,
) -> ReplayReport:
    """Replay ``trace`` on ``job``'s ``component`` (see the module docstring); token ids in
    ``[0, vocab)``. With ``score``, each episode's whole context is handed to that
    component (an inference role: a reference model's or the old policy's log-probs) as
    the episode ends, and the iteration ends with the last score. Raises BackendError when
    a turn fails or comes back short, or a score comes back without log-probs."""
    replay = _Replay(trace, vocab=vocab, seed=seed)
    output = job.output(component)
    n = trace.num_samples
    turns_left, ended = int(trace.turn_start[-1]), 0
    spans: list[tuple[float, float]] = []

    def progress() -> None:
        """What is left, for the scheduler: the rollout's turns (those still to come
        included), the scorer's episodes handed to it and not scored yet."""
        job.set_remaining(component, turns_left)
        if score is not None:
            job.set_remaining(score, ended - len(spans))

    async def tool(s: int, t: int) -> None:
        await asyncio.sleep(float(trace.tool_latency[t]))
        job.submit(component, [replay.next_turn(s, t)])

    async def scores() -> None:
        assert score is not None
        channel = job.output(score)
        while len(spans) < n:
            sample = await channel.get(timeout=timeout_s)
            if len(sample.logprobs) != len(sample.token_ids) - 4:
                raise BackendError(
                    f"replay: score {sample.sample_id} came back without a log-prob per token "
                    f"({sample.metadata.get('finish')}: {sample.metadata.get('error')})"
                )
            spans.append((replay.submitted.pop(sample.sample_id), replay.clock()))
            progress()

    progress()
    async with asyncio.timeout(timeout_s), asyncio.TaskGroup() as tasks:
        if score is not None:
            tasks.create_task(scores())
        job.submit(component, [replay.request(s) for s in range(n)])
        while ended < n:
            sample = await output.get(timeout=timeout_s)
            t = replay.absorb(sample)
            turns_left -= 1
            if t is not None:
                tasks.create_task(tool(*t))
            else:
                ended += 1
                if score is not None:
                    job.submit(score, [replay.episode(sample)])
            progress()
        rollout_s = replay.clock()
    return ReplayReport(
        wall_s=replay.clock(),
        turns=tuple(replay.records),
        rollout_s=rollout_s,
        score_spans=tuple(spans),
    )


class _Replay:
    """The episodes' state while a trace replays: contexts, turns, what the engine had."""

    def __init__(self, trace: IterationTrace, *, vocab: int, seed: int) -> None:
        self.trace, self.vocab, self.seed = trace, vocab, seed
        n = trace.num_samples
        self.contexts = {
            s: turn_tokens(seed, 0, int(trace.group[s]), int(trace.prompt[s]), vocab)
            for s in range(n)
        }
        self.reusable = dict.fromkeys(range(n), 0)
        self.attained = dict.fromkeys(range(n), 0)
        self.turn = dict.fromkeys(range(n), 0)
        self.submitted: dict[str, float] = {}
        self.records: list[TurnRecord] = []
        self._began = time.perf_counter()

    def clock(self) -> float:
        """Seconds since the replay began."""
        return time.perf_counter() - self._began

    def request(self, s: int) -> GenerationRequest:
        """Episode ``s``'s current turn."""
        trace, k = self.trace, self.turn[s]
        t = int(trace.turn_start[s]) + k
        ok = trace.tool_ok is None or k == 0 or bool(trace.tool_ok[t - 1])
        sample_id = f"{trace.iteration}-{s}/t{k}"
        self.submitted[sample_id] = self.clock()
        return GenerationRequest(
            sample_id=sample_id,
            token_ids=pack_tokens(self.contexts[s]),
            max_new_tokens=int(trace.output[t]),
            prompt_id=f"{trace.iteration}-g{int(trace.group[s])}",
            temperature=0.0,
            metadata={
                "episode": f"{trace.iteration}-{s}",
                "affinity": "prefer",
                "tool_calls": k,
                "attained_service": self.attained[s],
                "tool_ok": ok,
                "replay_sample": s,
            },
        )

    def next_turn(self, s: int, t: int) -> GenerationRequest:
        """Episode ``s``'s next turn, once turn ``t``'s tool result is in its context."""
        observation = turn_tokens(self.seed, 1, t, int(self.trace.observation[t]), self.vocab)
        self.contexts[s] = self.contexts[s] + observation
        self.turn[s] += 1
        return self.request(s)

    def episode(self, sample: Sample) -> Sample:
        """Episode ``sample``'s whole context (its last turn's output) to score."""
        s = int(sample.metadata["replay_sample"] or 0)
        sample_id = f"{self.trace.iteration}-{s}/score"
        self.submitted[sample_id] = self.clock()
        return Sample(
            sample_id=sample_id,
            token_ids=sample.token_ids,
            prompt_len=int(self.trace.prompt[s]),
            prompt_id=sample.prompt_id,
            metadata={"episode": f"{self.trace.iteration}-{s}", "replay_sample": s},
        )

    def absorb(self, sample: Sample) -> tuple[int, int] | None:
        """Record one finished turn; ``(episode, turn index)`` whose tool call runs next,
        or None when it ended its episode. BackendError for a failed or short turn."""
        s = sample.metadata.get("replay_sample")
        if not isinstance(s, int) or s not in self.contexts:
            raise BackendError(f"replay: sample {sample.sample_id} is no turn of this trace")
        trace = self.trace
        tokens = [int(x) for x in unpack_tokens(sample.token_ids)]
        new = tokens[sample.prompt_len :]
        t = int(trace.turn_start[s]) + self.turn[s]
        if sample.metadata.get("finish") == "error" or len(new) != int(trace.output[t]):
            raise BackendError(
                f"replay: turn {sample.sample_id} came back with {len(new)} of "
                f"{int(trace.output[t])} tokens ({sample.metadata.get('finish')})"
            )
        cached, device = sample.metadata.get(_CACHED, 0), sample.metadata.get("device", -1)
        self.records.append(
            TurnRecord(
                sample=s,
                turn=self.turn[s],
                prompt_tokens=sample.prompt_len,
                reusable=self.reusable[s],
                cached_tokens=cached if isinstance(cached, int) else 0,
                output_tokens=len(new),
                submitted_s=self.submitted.pop(sample.sample_id),
                finished_s=self.clock(),
                device=device if isinstance(device, int) else -1,
            )
        )
        self.contexts[s] = tokens
        self.reusable[s] = len(tokens)
        self.attained[s] += len(new)
        return None if t + 1 >= int(trace.turn_start[s + 1]) else (s, t)
