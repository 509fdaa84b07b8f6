"""The episodes of one GRPO step, kept by the driver: turns, tool calls, rewards, groups.

For each problem of the step, ``group_size`` episodes. An episode's first turn is a bus
``GenerationRequest`` for the prompt; when a turn ends with a closed tool call (multi-turn
task) the driver runs the call and :meth:`Episodes.tool_result` returns the next turn's
request — the whole episode so far as its prompt, its own request id, the same integer
sampling id — and when it ends otherwise the episode is scored by the task's exact
checker. A prompt group whose episodes are all scored is *complete*: its GRPO advantages
are computed and its samples are one micro-batch of the step. Every sample records the
log-probs its tokens were generated with and their weight versions. Pure bookkeeping;
runs in the driver's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dynarl.backends._grpo import group_advantages
from dynarl.backends.reference._samples import (
    ADVANTAGE,
    ENV_SPANS,
    GROUP,
    SEED_ID,
    STEP,
    TOOL_CALLS,
    encode_spans,
)
from dynarl.backends.reference._setup import ReferenceSetup
from dynarl.backends.reference._tasks import Problem, Task
from dynarl.backends.reference._tokenizer import CharTokenizer
from dynarl.bus import GenerationRequest, MetaValue, Sample, pack_tokens, unpack_tokens
from dynarl.runtime import FINISH, RESUMED, VERSIONS

__all__ = ["Episodes", "ToolCall"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCall:
    """A tool call an episode's turn ended with."""

    sample_id: int
    """The episode."""
    expression: str
    """What the model asked the calculator."""
    call_id: int
    """Unique per episode and call (keys the tool's latency draw)."""


@dataclass(slots=True)
class _Episode:
    sample_id: int
    group: int
    problem: Problem
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: bytes = b""
    versions: str = ""
    env: list[tuple[int, int]] = field(default_factory=list)
    calls: int = 0
    resumed: int = 0
    done: Sample | None = None


class Episodes:
    """The episodes of step ``step`` over ``problems`` (see the module docstring)."""

    def __init__(
        self, setup: ReferenceSetup, task: Task, step: int, problems: Sequence[Problem]
    ) -> None:
        self.setup, self.task, self.step = setup, task, step
        self.tokenizer = CharTokenizer()
        self._eos = self.tokenizer.eos_id
        self._episodes: dict[int, _Episode] = {}
        self._groups: list[list[int]] = []
        for group, problem in enumerate(problems):
            prompt = self.tokenizer.encode(problem.prompt, bos=True)
            ids = []
            for index in range(setup.group_size):
                sample_id = problem.problem_id * setup.group_size + index
                self._episodes[sample_id] = _Episode(sample_id, group, problem, list(prompt))
                ids.append(sample_id)
            self._groups.append(ids)
        self._complete: set[int] = set()

    @property
    def num_samples(self) -> int:
        """Episodes of the step."""
        return len(self._episodes)

    @property
    def num_groups(self) -> int:
        """Prompt groups (micro-batches) of the step."""
        return len(self._groups)

    @property
    def num_done(self) -> int:
        """Episodes scored so far."""
        return sum(ep.done is not None for ep in self._episodes.values())

    def first_requests(self) -> list[GenerationRequest]:
        """The first turn of every episode, in sample-id order."""
        return [self._request(ep) for ep in sorted(self._episodes.values(), key=_by_id)]

    def _request(self, ep: _Episode) -> GenerationRequest:
        context = ep.prompt + ep.response
        room = self.setup.engine.max_seq_len - 1 - len(context)
        budget = min(self.setup.max_response_tokens - len(ep.response), room)
        meta: dict[str, MetaValue] = {
            SEED_ID: ep.sample_id,
            GROUP: ep.group,
            STEP: self.step,
            TOOL_CALLS: ep.calls,
            # A prompt group prefers one engine (its shared prompt is one prefix-cache
            # entry there) unless that engine is much busier than another.
            "episode": f"{self.step}-{ep.group}",
            "affinity": "prefer",
        }
        return GenerationRequest(
            sample_id=f"{ep.sample_id}" if not ep.calls else f"{ep.sample_id}/t{ep.calls}",
            token_ids=pack_tokens(context),
            max_new_tokens=max(budget, 1),
            prompt_id=f"{self.step}-{ep.group}",
            temperature=self.setup.temperature,
            seed=self.setup.seed,
            metadata=meta,
        )

    def absorb(self, sample: Sample) -> ToolCall | None:
        """Fold one finished turn in; the tool call it ended with, if any. Raises
        ValueError for an unknown or finished episode."""
        seed_id = sample.metadata.get(SEED_ID)
        ep = self._episodes.get(int(seed_id) if isinstance(seed_id, int) else -1)
        if ep is None or ep.done is not None:
            raise ValueError(f"sample {sample.sample_id} is not a running episode of this step")
        new = [int(t) for t in unpack_tokens(sample.token_ids)[sample.prompt_len :]]
        ep.response += new
        ep.logprobs += sample.logprobs
        versions = sample.metadata.get(VERSIONS)
        if isinstance(versions, str) and versions:
            ep.versions = f"{ep.versions},{versions}" if ep.versions else versions
        resumed = sample.metadata.get(RESUMED, 0)
        ep.resumed += int(resumed) if isinstance(resumed, int) else 0
        last = new[-1] if new else None
        finish = sample.metadata.get(FINISH)
        if finish == "stop" and last is not None and last != self._eos:
            expression = self.task.tool_call(self.tokenizer.decode(ep.response))
            if expression is not None and ep.calls < self.setup.max_tool_calls_per_episode:
                return ToolCall(
                    sample_id=ep.sample_id,
                    expression=expression,
                    call_id=ep.sample_id * 64 + ep.calls,
                )
        self._finish(ep, finished=last == self._eos)
        return None

    def tool_result(self, call: ToolCall, output: str) -> GenerationRequest | None:
        """Append the tool's answer; the episode's next turn (None: it is out of budget)."""
        ep = self._episodes[call.sample_id]
        result = self.tokenizer.encode("{" + output + "}")
        start = len(ep.response)
        ep.response += result
        ep.env.append((start, start + len(result)))
        ep.calls += 1
        room = self.setup.engine.max_seq_len - 1 - len(ep.prompt) - len(ep.response)
        if len(ep.response) >= self.setup.max_response_tokens or room < 1:
            self._finish(ep, finished=False)
            return None
        return self._request(ep)

    def _finish(self, ep: _Episode, *, finished: bool) -> None:
        tokens = ep.response[:-1] if finished else ep.response
        text = self.tokenizer.decode(tokens)
        reward = self.task.reward(ep.problem, text, finished=finished)
        meta: dict[str, MetaValue] = {
            SEED_ID: ep.sample_id,
            GROUP: ep.group,
            STEP: self.step,
            TOOL_CALLS: ep.calls,
            RESUMED: ep.resumed,
            VERSIONS: ep.versions,
            ENV_SPANS: encode_spans(ep.env),
            "finished": finished,
        }
        ep.done = Sample(
            sample_id=str(ep.sample_id),
            token_ids=pack_tokens(ep.prompt + ep.response),
            prompt_len=len(ep.prompt),
            prompt_id=f"{self.step}-{ep.group}",
            reward=reward,
            logprobs=ep.logprobs,
            metadata=meta,
        )

    def complete_groups(self) -> list[int]:
        """Groups that became complete since the last call, ascending."""
        fresh = [
            g
            for g, ids in enumerate(self._groups)
            if g not in self._complete and all(self._episodes[i].done is not None for i in ids)
        ]
        self._complete.update(fresh)
        return fresh

    def micro_batch(self, group: int) -> list[Sample]:
        """The scored samples of a complete group with their advantages, in id order.

        Raises ValueError for a group that is not complete.
        """
        eps = [self._episodes[i] for i in self._groups[group]]
        if any(ep.done is None for ep in eps):
            raise ValueError(f"group {group} is not complete")
        samples = [ep.done for ep in eps if ep.done is not None]
        rewards = torch.tensor([[float(s.reward or 0.0) for s in samples]])
        grpo = self.setup.train.grpo
        adv = group_advantages(rewards, normalize_std=grpo.normalize_std, eps=grpo.adv_eps)
        return [
            Sample(
                sample_id=s.sample_id,
                token_ids=s.token_ids,
                prompt_len=s.prompt_len,
                prompt_id=s.prompt_id,
                reward=s.reward,
                logprobs=s.logprobs,
                metadata={**s.metadata, ADVANTAGE: float(a)},
            )
            for s, a in zip(samples, adv[0].tolist(), strict=True)
        ]

    def rewards(self) -> list[float]:
        """Rewards of every episode, in sample-id order (0 for unscored ones)."""
        return [
            float(ep.done.reward or 0.0) if ep.done is not None else 0.0
            for ep in sorted(self._episodes.values(), key=_by_id)
        ]


def _by_id(ep: _Episode) -> int:
    return ep.sample_id
