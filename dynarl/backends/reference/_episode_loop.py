"""Episodes: drive a rollout engine and a tool worker until every sample is done.

For each problem, ``group_size`` samples are generated (GRPO's group). A sample is an
episode: the engine generates until EOS, the length budget, or — in a tool task — a
closed tool call ``[expr]``; then the tool worker answers, ``{result}`` is appended
(tokens the policy did not write: masked out of training, log-prob 0, version −1) and
the episode goes back to the engine as a new turn whose prompt is the whole episode so
far, so the prefix cache serves it. Rewards come from the task's exact checker.

:func:`collect_rollouts` is the single-process form: one asyncio loop steps the engine
(synchronous compute) and runs tool calls as tasks of one TaskGroup, so tool latency
overlaps generation. The runtime distributes the same episode logic across processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from dynarl.backends._grpo import TrainSample
from dynarl.backends.reference._request import FinishReason, GenerationOutput, GenerationRequest
from dynarl.backends.reference._rollout_engine import RolloutEngine
from dynarl.backends.reference._tasks import Problem, Task
from dynarl.backends.reference._tokenizer import CharTokenizer
from dynarl.backends.reference._tools import ToolWorker
from dynarl.errors import BackendError

__all__ = ["RolloutConfig", "Sample", "collect_rollouts"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """How episodes are generated."""

    group_size: int = 8
    """Samples per problem."""
    max_response_tokens: int = 96
    """Token budget of a whole response (tool results included)."""
    max_tool_calls: int = 8
    """An episode ends unfinished after this many calls."""
    temperature: float = 1.0
    """Sampling temperature."""
    seed: int = 0
    """Job seed (keys sampling with sample id and position)."""
    idle_timeout_s: float = 60.0
    """Longest wait for a tool answer while the engine has nothing to do."""

    def __post_init__(self) -> None:
        for name in ("group_size", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1")
        if self.max_tool_calls < 0 or self.temperature < 0 or self.idle_timeout_s <= 0:
            raise ValueError("RolloutConfig: bad max_tool_calls, temperature or idle_timeout_s")


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One finished episode: tokens, provenance of every token, reward."""

    sample_id: int
    """``problem_id * group_size + index in group``."""
    problem: Problem
    """The problem it answers."""
    prompt_tokens: tuple[int, ...]
    """BOS and the prompt."""
    response_tokens: tuple[int, ...]
    """Everything after the prompt: generated tokens and tool results."""
    policy_mask: tuple[bool, ...]
    """Per response token: True if the policy generated it."""
    logprobs: tuple[float, ...]
    """Per response token: log-prob it was sampled with (0.0 for tool results)."""
    versions: tuple[int, ...]
    """Per response token: weight version it was sampled with (−1 for tool results)."""
    reward: float
    """The checker's reward."""
    finished: bool
    """Whether the response ended with EOS."""
    num_tool_calls: int
    """Tool calls made."""
    text: str
    """The response as text (tool results included, EOS dropped)."""

    @property
    def tokens(self) -> tuple[int, ...]:
        """Prompt and response."""
        return self.prompt_tokens + self.response_tokens

    def train_sample(
        self,
        advantage: float,
        *,
        old_logprobs: Sequence[float] | None = None,
        ref_logprobs: Sequence[float] | None = None,
    ) -> TrainSample:
        """This episode as a :class:`TrainSample` (per-target arrays over all tokens)."""
        mask = (False,) * (len(self.prompt_tokens) - 1) + self.policy_mask
        return TrainSample(
            tokens=self.tokens,
            loss_mask=mask,
            advantage=advantage,
            old_logprobs=None if old_logprobs is None else tuple(old_logprobs),
            ref_logprobs=None if ref_logprobs is None else tuple(ref_logprobs),
        )


class _Episode:
    __slots__ = ("calls", "logprobs", "mask", "problem", "prompt", "response", "versions")

    def __init__(self, problem: Problem, prompt: tuple[int, ...]) -> None:
        self.problem, self.prompt = problem, prompt
        self.response: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.calls = 0

    def add(
        self,
        tokens: Sequence[int],
        policy: bool,
        logprobs: Sequence[float] = (),
        versions: Sequence[int] = (),
    ) -> None:
        self.response += tokens
        self.mask += [policy] * len(tokens)
        self.logprobs += logprobs if policy else [0.0] * len(tokens)
        self.versions += versions if policy else [-1] * len(tokens)


class _Driver:
    def __init__(
        self,
        engine: RolloutEngine,
        task: Task,
        tokenizer: CharTokenizer,
        config: RolloutConfig,
        tool: ToolWorker | None,
    ) -> None:
        self.engine, self.task, self.tok, self.config = engine, task, tokenizer, config
        self.tool = tool
        self.stop_tokens = (tokenizer.eos_id, *tokenizer.ids_of(task.stop_chars))
        self.episodes: dict[int, _Episode] = {}
        self.done: dict[int, Sample] = {}
        self.wakeup = asyncio.Event()

    def submit_turn(self, sample_id: int) -> None:
        ep = self.episodes[sample_id]
        budget = self.config.max_response_tokens - len(ep.response)
        context = ep.prompt + tuple(ep.response)
        if budget < 1 or len(context) >= self.engine.config.max_seq_len:
            self.finish(sample_id, finished=False)
            return
        self.engine.submit(
            GenerationRequest(
                sample_id=sample_id,
                prompt=context,
                max_new_tokens=budget,
                seed=self.config.seed,
                temperature=self.config.temperature,
                stop_tokens=self.stop_tokens,
                num_tool_calls=ep.calls,
            )
        )

    def finish(self, sample_id: int, *, finished: bool) -> None:
        ep = self.episodes.pop(sample_id)
        tokens = ep.response[:-1] if finished else ep.response
        text = self.tok.decode(tokens)
        self.done[sample_id] = Sample(
            sample_id=sample_id,
            problem=ep.problem,
            prompt_tokens=ep.prompt,
            response_tokens=tuple(ep.response),
            policy_mask=tuple(ep.mask),
            logprobs=tuple(ep.logprobs),
            versions=tuple(ep.versions),
            reward=self.task.reward(ep.problem, text, finished=finished),
            finished=finished,
            num_tool_calls=ep.calls,
            text=text,
        )

    def on_output(self, out: GenerationOutput, tg: asyncio.TaskGroup) -> None:
        ep = self.episodes[out.sample_id]
        ep.add(out.tokens, True, out.logprobs, out.versions)
        last = out.tokens[-1] if out.tokens else None
        if out.finish_reason is not FinishReason.STOP or last == self.tok.eos_id:
            self.finish(out.sample_id, finished=last == self.tok.eos_id)
        elif self.tool is None or ep.calls >= self.config.max_tool_calls:
            self.finish(out.sample_id, finished=False)
        else:
            expression = self.task.tool_call(self.tok.decode(ep.response)) or ""
            tg.create_task(self.call_tool(out.sample_id, expression))

    async def call_tool(self, sample_id: int, expression: str) -> None:
        assert self.tool is not None
        ep = self.episodes[sample_id]
        result = await self.tool.call(expression, call_id=sample_id * 64 + ep.calls)
        ep.calls += 1
        ep.add(self.tok.encode("{" + result.output + "}"), False)
        self.submit_turn(sample_id)
        self.wakeup.set()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while self.episodes:
                if self.engine.has_work:
                    for out in self.engine.step():
                        self.on_output(out, tg)
                    await asyncio.sleep(0)  # let finished tool calls submit their next turn
                    continue
                self.wakeup.clear()
                try:
                    async with asyncio.timeout(self.config.idle_timeout_s):
                        await self.wakeup.wait()
                except TimeoutError:
                    raise BackendError("no tool answer within idle_timeout_s") from None


async def collect_rollouts(
    engine: RolloutEngine,
    task: Task,
    tokenizer: CharTokenizer,
    problems: Sequence[Problem],
    config: RolloutConfig,
    *,
    tool: ToolWorker | None = None,
) -> list[Sample]:
    """Generate ``group_size`` episodes per problem; samples in (problem, index) order.

    Runs on the calling event loop; the engine must have weights loaded. Raises
    BackendError if a tool answer does not come within ``idle_timeout_s``.
    """
    driver = _Driver(engine, task, tokenizer, config, tool)
    for problem in problems:
        prompt = tuple(tokenizer.encode(problem.prompt, bos=True))
        for index in range(config.group_size):
            sample_id = problem.problem_id * config.group_size + index
            driver.episodes[sample_id] = _Episode(problem, prompt)
    for sample_id in list(driver.episodes):
        driver.submit_turn(sample_id)
    await driver.run()
    return [driver.done[sample_id] for sample_id in sorted(driver.done)]
