"""The reference backend's two RL tasks, each with an exact checker.

* :class:`ChainSumTask` (single turn, math-like): the prompt lists digits, the response
  is the chain of running sums mod 10 and the final answer after ``#``
  (``S:3,5,2=`` → ``3,8,0#0``). The number of terms is drawn from a lognormal, so the
  length of a correct response — two tokens per term — is heavy-tailed: most answers are
  short, a few run long. The tail is a property of the prompts and of what the policy
  generates, never a sleep: an untrained policy stops wherever it samples EOS; a trained
  one writes as many steps as the prompt has terms.
* :class:`ToolCalcTask` (multi-turn): the prompt is a sum of products
  (``T:12*34+5*6=``); the model calls the calculator with ``[expr]``, the environment
  appends ``{result}`` and generation continues, so an episode with k products makes
  2k − 1 calls (``[12*34]{408}[5*6]{30}[408+30]{438}#438``).

Rewards are 1.0 for an exact final answer after ``#`` in a response that ended with EOS,
0.0 otherwise. Problems are drawn from ``random.Random`` keyed by (seed, step), so every
run, static or dynamic, sees the same prompts. Pure Python; no I/O.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

from dynarl.backends._grpo import TrainSample
from dynarl.backends.reference._tokenizer import CharTokenizer

__all__ = [
    "ChainSumTask",
    "Problem",
    "Task",
    "ToolCalcTask",
    "environment_mask",
    "sft_samples",
]

ANSWER_MARK = "#"
CALL_OPEN, CALL_CLOSE = "[", "]"
RESULT_OPEN, RESULT_CLOSE = "{", "}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """One prompt with its checker's answer and a correct response."""

    problem_id: int
    """Unique per (task seed, step, index)."""
    prompt: str
    """Prompt text (without BOS)."""
    answer: str
    """The exact final answer the checker accepts."""
    reference: str
    """A correct response, tool results included (used by the supervised warm start)."""


class Task(Protocol):
    """What the rollout driver and the smoke loop need from a task."""

    @property
    def name(self) -> str:
        """Short task name."""
        ...

    @property
    def stop_chars(self) -> str:
        """Characters that end one generation turn besides EOS (a tool-call close)."""
        ...

    def problems(self, *, step: int, num_problems: int) -> tuple[Problem, ...]:
        """The prompts of training step ``step`` (deterministic in seed and step)."""
        ...

    def tool_call(self, response: str) -> str | None:
        """The expression of the call ``response`` ends with, or None if it ends otherwise."""
        ...

    def reward(self, problem: Problem, response: str, *, finished: bool) -> float:
        """Exact-checker reward of a full response; ``finished``: it ended with EOS."""
        ...


def _final_answer_reward(problem: Problem, response: str, *, finished: bool) -> float:
    if not finished or ANSWER_MARK not in response:
        return 0.0
    return 1.0 if response.rpartition(ANSWER_MARK)[2] == problem.answer else 0.0


def environment_mask(response: str) -> list[bool]:
    """Per character of ``response``: True where the model wrote it, False inside a
    ``{...}`` tool result (braces included), which the environment appended."""
    mask, inside = [], False
    for ch in response:
        if ch == RESULT_OPEN:
            inside = True
        mask.append(not inside)
        if ch == RESULT_CLOSE:
            inside = False
    return mask


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainSumTask:
    """Running sums mod 10 over a heavy-tailed number of digits (single turn)."""

    seed: int = 0
    """Problems are drawn from random.Random keyed by (seed, step)."""
    median_terms: float = 3.0
    """Median number of digits in a prompt."""
    sigma: float = 0.8
    """Standard deviation of the log of the number of digits."""
    max_terms: int = 24
    """Upper bound on the number of digits."""
    dataset_size: int = 0
    """0: fresh problems every step; n: a fixed dataset of n problems, cycled in epochs."""

    def __post_init__(self) -> None:
        _check_dataset(self.dataset_size)
        if self.median_terms < 1:
            raise ValueError(f"ChainSumTask.median_terms must be >= 1, got {self.median_terms}")
        if self.sigma < 0:
            raise ValueError(f"ChainSumTask.sigma must be >= 0, got {self.sigma}")
        if self.max_terms < 1:
            raise ValueError(f"ChainSumTask.max_terms must be >= 1, got {self.max_terms}")

    @property
    def name(self) -> str:
        """``"chain_sum"``."""
        return "chain_sum"

    @property
    def stop_chars(self) -> str:
        """Single turn: no stop character besides EOS."""
        return ""

    def num_terms(self, rng: random.Random) -> int:
        """One draw of the number of digits: lognormal, rounded, clipped."""
        draw = self.median_terms * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return max(1, min(self.max_terms, round(draw)))

    def problems(self, *, step: int, num_problems: int) -> tuple[Problem, ...]:
        """``num_problems`` prompts for ``step``; raises ValueError if either is negative."""
        _check_counts(step, num_problems)
        return tuple(
            self._problem(_item_rng(self, step, num_problems, index), _problem_id(step, index))
            for index in range(num_problems)
        )

    def _problem(self, rng: random.Random, problem_id: int) -> Problem:
        digits = [rng.randrange(10) for _ in range(self.num_terms(rng))]
        sums, total = [], 0
        for digit in digits:
            total = (total + digit) % 10
            sums.append(str(total))
        prompt = "S:" + ",".join(map(str, digits)) + "="
        reference = ",".join(sums) + ANSWER_MARK + sums[-1]
        return Problem(problem_id=problem_id, prompt=prompt, answer=sums[-1], reference=reference)

    def tool_call(self, response: str) -> str | None:
        """Single turn: never a tool call."""
        return None

    def reward(self, problem: Problem, response: str, *, finished: bool) -> float:
        """1.0 iff the response ended with EOS and its text after the last ``#`` is the
        answer."""
        return _final_answer_reward(problem, response, finished=finished)


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCalcTask:
    """Sums of products solved by calling the calculator (multi-turn)."""

    seed: int = 0
    """Problems are drawn from random.Random keyed by (seed, step)."""
    min_products: int = 2
    """Fewest products in a prompt (an episode makes 2k − 1 calls for k products)."""
    max_products: int = 4
    """Most products in a prompt."""
    max_operand: int = 20
    """Operands are drawn from [2, max_operand]."""
    dataset_size: int = 0
    """0: fresh problems every step; n: a fixed dataset of n problems, cycled in epochs."""

    def __post_init__(self) -> None:
        _check_dataset(self.dataset_size)
        if not 1 <= self.min_products <= self.max_products:
            raise ValueError("ToolCalcTask needs 1 <= min_products <= max_products")
        if self.max_operand < 2:
            raise ValueError(f"ToolCalcTask.max_operand must be >= 2, got {self.max_operand}")

    @property
    def name(self) -> str:
        """``"tool_calc"``."""
        return "tool_calc"

    @property
    def stop_chars(self) -> str:
        """A turn ends when the model closes a tool call."""
        return CALL_CLOSE

    def problems(self, *, step: int, num_problems: int) -> tuple[Problem, ...]:
        """``num_problems`` prompts for ``step``; raises ValueError if either is negative."""
        _check_counts(step, num_problems)
        return tuple(
            self._problem(_item_rng(self, step, num_problems, index), _problem_id(step, index))
            for index in range(num_problems)
        )

    def _num_products(self, rng: random.Random) -> int:
        count = self.min_products
        while count < self.max_products and rng.random() < 0.5:
            count += 1
        return count

    def _problem(self, rng: random.Random, problem_id: int) -> Problem:
        pairs = [
            (rng.randint(2, self.max_operand), rng.randint(2, self.max_operand))
            for _ in range(self._num_products(rng))
        ]
        prompt = "T:" + "+".join(f"{a}*{b}" for a, b in pairs) + "="
        steps = [(f"{a}*{b}", a * b) for a, b in pairs]
        total = steps[0][1]
        for _, value in steps[1:]:
            steps.append((f"{total}+{value}", total + value))
            total += value
        reference = "".join(
            f"{CALL_OPEN}{expr}{CALL_CLOSE}{RESULT_OPEN}{value}{RESULT_CLOSE}"
            for expr, value in steps
        )
        reference += ANSWER_MARK + str(total)
        return Problem(problem_id=problem_id, prompt=prompt, answer=str(total), reference=reference)

    def tool_call(self, response: str) -> str | None:
        """The text inside the final ``[...]`` if ``response`` ends with ``]``."""
        if not response.endswith(CALL_CLOSE):
            return None
        _, bracket, expression = response[:-1].rpartition(CALL_OPEN)
        return expression if bracket else None

    def reward(self, problem: Problem, response: str, *, finished: bool) -> float:
        """1.0 iff the response ended with EOS and its text after the last ``#`` is the
        answer."""
        return _final_answer_reward(problem, response, finished=finished)


class _Drawn(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def dataset_size(self) -> int: ...


def _item_rng(task: _Drawn, step: int, num_problems: int, index: int) -> random.Random:
    """The generator a problem is drawn from: keyed by (seed, step, index), or by the
    dataset item when the task has a fixed dataset (so epochs repeat prompts, while
    problem ids — and hence sample ids — stay unique)."""
    if task.dataset_size:
        item = (step * num_problems + index) % task.dataset_size
        return random.Random(f"{task.name}:{task.seed}:item:{item}")
    return random.Random(f"{task.name}:{task.seed}:{step}:{index}")


def _check_dataset(size: int) -> None:
    if size < 0:
        raise ValueError(f"dataset_size must be >= 0, got {size}")


def _problem_id(step: int, index: int) -> int:
    return step * 1_000_000 + index


def _check_counts(step: int, num_problems: int) -> None:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0 <= num_problems < 1_000_000:
        raise ValueError(f"num_problems must be in [0, 1e6), got {num_problems}")


def sft_samples(
    task: Task, tokenizer: CharTokenizer, *, step: int, batch_size: int
) -> list[TrainSample]:
    """Reference responses as supervised samples; tool results are masked out."""
    samples = []
    for problem in task.problems(step=step, num_problems=batch_size):
        prompt = tokenizer.encode(problem.prompt, bos=True)
        response = tokenizer.encode(problem.reference, eos=True)
        mask = [False] * (len(prompt) - 1) + environment_mask(problem.reference) + [True]
        samples.append(TrainSample(tokens=tuple(prompt + response), loss_mask=tuple(mask)))
    return samples
