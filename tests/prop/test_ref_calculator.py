"""Property tests of the reference calculator: never raises, evaluates integer trees exactly."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dynarl.backends.reference._tools import Calculator

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@st.composite
def _expression(draw: st.DrawFn, depth: int = 3) -> tuple[str, int, int]:
    """(text, value, largest magnitude of any operand or intermediate result)."""
    if depth == 0 or draw(st.booleans()):
        value = draw(st.integers(0, 999))
        return str(value), value, value
    op = draw(st.sampled_from(sorted(_OPS)))
    left, lv, lmax = draw(_expression(depth - 1))
    right, rv, rmax = draw(_expression(depth - 1))
    value = _OPS[op](lv, rv)
    return f"({left}{op}{right})", value, max(lmax, rmax, abs(value))


@given(_expression())
def test_calculator_matches_integer_arithmetic(case: tuple[str, int, int]) -> None:
    text, value, largest = case
    calc = Calculator(max_chars=400, max_abs_value=10**9)
    expected = str(value) if largest <= calc.max_abs_value else "ERR"
    assert calc.evaluate(text) == expected


@given(st.text(max_size=80))
def test_calculator_never_raises(text: str) -> None:
    out = Calculator().evaluate(text)
    assert out == "ERR" or out.lstrip("-").isdigit()
