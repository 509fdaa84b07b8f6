"""The tool worker of the reference backend: a calculator behind a latency distribution.

:class:`Calculator` evaluates integer arithmetic for real by walking the ``ast`` of the
expression (no ``eval``); anything else — names, calls, attributes, huge numbers — is
refused with an ``ERR`` result, because in RL a malformed tool call is an ordinary model
output, not a program error. :class:`ToolWorker` puts a configurable latency
distribution in front of it, the way a remote tool service answers after a network and
queueing delay; the latency is a real ``asyncio.sleep`` in the worker's event loop, so it
occupies wall time but no compute.
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Calculator", "ToolLatency", "ToolResult", "ToolWorker"]

ERROR_RESULT = "ERR"

_BINARY: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type[ast.unaryop], Callable[[int], int]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class _Refused(Exception):
    """The expression is outside what the calculator evaluates."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Calculator:
    """Evaluates integer expressions with ``+ - * // %``, unary signs and parentheses.

    ``/`` is accepted as integer (floor) division, since the task alphabet has no ``//``.
    Pure and thread-safe; runs on whichever thread calls it.
    """

    max_chars: int = 64
    """Longer expressions are refused."""
    max_abs_value: int = 10**12
    """Any operand or intermediate result larger in magnitude is refused."""

    def __post_init__(self) -> None:
        if self.max_chars < 1:
            raise ValueError(f"Calculator.max_chars must be >= 1, got {self.max_chars}")
        if self.max_abs_value < 1:
            raise ValueError(f"Calculator.max_abs_value must be >= 1, got {self.max_abs_value}")

    def evaluate(self, expression: str) -> str:
        """The value of ``expression`` as decimal text, or ``"ERR"`` if it is refused.

        Never raises for any input string.
        """
        if len(expression) > self.max_chars or not expression.strip():
            return ERROR_RESULT
        try:
            tree = ast.parse(expression.replace("/", "//"), mode="eval")
            return str(self._value(tree.body))
        except (_Refused, SyntaxError, ValueError, ZeroDivisionError, RecursionError):
            return ERROR_RESULT

    def _value(self, node: ast.expr) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return self._checked(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._value(node.left), self._value(node.right)
            return self._checked(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._checked(_UNARY[type(node.op)](self._value(node.operand)))
        raise _Refused(type(node).__name__)

    def _checked(self, value: int) -> int:
        if abs(value) > self.max_abs_value:
            raise _Refused("value out of range")
        return value


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolLatency:
    """A lognormal latency distribution, truncated to ``[min_s, max_s]``.

    ``median_s=0`` gives a tool that answers at once (unit tests, single-process smoke).
    """

    median_s: float = 0.05
    """Median latency, seconds."""
    sigma: float = 0.5
    """Standard deviation of log-latency (0: every call takes ``median_s``)."""
    min_s: float = 0.0
    """Lower bound, seconds."""
    max_s: float = 2.0
    """Upper bound, seconds."""

    def __post_init__(self) -> None:
        if self.median_s < 0:
            raise ValueError(f"ToolLatency.median_s must be >= 0, got {self.median_s}")
        if self.sigma < 0:
            raise ValueError(f"ToolLatency.sigma must be >= 0, got {self.sigma}")
        if not 0 <= self.min_s <= self.max_s:
            raise ValueError("ToolLatency needs 0 <= min_s <= max_s")

    def sample(self, rng: random.Random) -> float:
        """One latency draw, seconds."""
        if self.median_s == 0:
            return self.min_s
        draw = self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return min(self.max_s, max(self.min_s, draw))


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolResult:
    """The answer to one tool call."""

    call_id: int
    """Identifies the call (unique within the episode's sample id)."""
    expression: str
    """The expression the model asked for."""
    output: str
    """The calculator's answer, or ``"ERR"``."""
    latency_s: float
    """How long the call took, seconds (the drawn latency)."""


class ToolWorker:
    """A calculator service with latency; one per tool device.

    Latencies are drawn from ``random.Random(seed ^ call_id)``, so a given call takes the
    same time wherever it runs. Runs on the event loop of the process that owns it;
    calls may overlap (the latency is a wait, not compute).
    """

    def __init__(
        self,
        *,
        latency: ToolLatency | None = None,
        calculator: Calculator | None = None,
        seed: int = 0,
    ) -> None:
        self.latency = latency or ToolLatency(median_s=0.0)
        self.calculator = calculator or Calculator()
        self.seed = seed
        self.num_calls = 0
        self.busy_s = 0.0

    def draw_latency(self, call_id: int) -> float:
        """The latency call ``call_id`` will take, seconds."""
        return self.latency.sample(random.Random(self.seed ^ (call_id * 0x9E3779B97F4A7C15)))

    def call_now(self, expression: str, *, call_id: int) -> ToolResult:
        """Evaluate without waiting (the latency is drawn and reported, not slept)."""
        self.num_calls += 1
        latency = self.draw_latency(call_id)
        self.busy_s += latency
        output = self.calculator.evaluate(expression)
        return ToolResult(call_id=call_id, expression=expression, output=output, latency_s=latency)

    async def call(self, expression: str, *, call_id: int) -> ToolResult:
        """Evaluate after sleeping the drawn latency."""
        result = self.call_now(expression, call_id=call_id)
        if result.latency_s > 0:
            await asyncio.sleep(result.latency_s)
        return result
