"""Tasks, tokenizer and the calculator tool of the reference backend."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from dynarl.backends.reference import (
    ChainSumTask,
    CharTokenizer,
    ToolCalcTask,
    ToolLatency,
    ToolWorker,
)
from dynarl.backends.reference._tasks import environment_mask
from dynarl.backends.reference._tools import Calculator


def test_tokenizer_round_trips_and_pads_the_vocabulary() -> None:
    tok = CharTokenizer()
    text = "S:3,5,2=3,8,0#0[12*34]{408}"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text
    assert tok.vocab_size % 64 == 0 and max(ids) < tok.vocab_size
    with pytest.raises(ValueError, match="not in the tokenizer alphabet"):
        tok.encode("x")
    with pytest.raises(ValueError, match="repeat"):
        CharTokenizer(alphabet="aa")


def test_chain_sum_problems_are_deterministic_and_checked_exactly() -> None:
    task = ChainSumTask(seed=3)
    first = task.problems(step=5, num_problems=20)
    assert first == task.problems(step=5, num_problems=20)
    assert first != task.problems(step=6, num_problems=20)
    assert len({p.problem_id for p in first}) == 20
    for problem in first:
        digits = [int(d) for d in problem.prompt[2:-1].split(",")]
        assert problem.answer == str(sum(digits) % 10)
        assert task.reward(problem, problem.reference, finished=True) == 1.0
        assert task.reward(problem, problem.reference, finished=False) == 0.0
        wrong = problem.reference[:-1] + str((int(problem.answer) + 1) % 10)
        assert task.reward(problem, wrong, finished=True) == 0.0
        assert task.tool_call(problem.reference + "]") is None


def test_chain_sum_lengths_are_heavy_tailed() -> None:
    problems = ChainSumTask(seed=0).problems(step=0, num_problems=2000)
    lengths = sorted(len(p.reference) for p in problems)
    median, p99 = statistics.median(lengths), lengths[int(0.99 * len(lengths))]
    # Lognormal term counts: the slowest 1% of answers are several times the median.
    assert p99 >= 3 * median
    assert lengths[-1] >= 5 * median


def test_fixed_dataset_repeats_prompts_with_fresh_ids() -> None:
    task = ChainSumTask(seed=1, dataset_size=8)
    epoch0 = task.problems(step=0, num_problems=8)
    epoch1 = task.problems(step=1, num_problems=8)
    assert [p.prompt for p in epoch0] == [p.prompt for p in epoch1]
    assert {p.problem_id for p in epoch0}.isdisjoint(p.problem_id for p in epoch1)


def test_tool_task_references_call_the_calculator_several_times() -> None:
    task = ToolCalcTask(seed=2, min_products=2, max_products=4)
    calc = Calculator()
    for problem in task.problems(step=0, num_problems=50):
        products = problem.prompt.count("*")
        assert problem.reference.count("[") == 2 * products - 1 >= 3
        # Replaying the reference through the tool gives back every result it shows.
        for span in problem.reference.split("[")[1:]:
            expression, rest = span.split("]", 1)
            assert rest.startswith("{" + calc.evaluate(expression) + "}")
        assert task.reward(problem, problem.reference, finished=True) == 1.0


def test_tool_call_parsing_and_environment_mask() -> None:
    task = ToolCalcTask()
    assert task.tool_call("[12*3]{36}[36+4]") == "36+4"
    assert task.tool_call("[12*3]{36}") is None
    assert task.tool_call("12]") is None
    text = "[2*3]{6}#6"
    mask = environment_mask(text)
    assert "".join(ch for ch, keep in zip(text, mask, strict=True) if keep) == "[2*3]#6"


def test_calculator_evaluates_and_refuses() -> None:
    calc = Calculator(max_abs_value=10**6)
    assert calc.evaluate("12*34+5") == "413"
    assert calc.evaluate("-(7-10)%4") == "3"
    assert calc.evaluate("17/5") == "3"
    for bad in ["__import__('os')", "2**10", "1.5*2", "a+1", "1/0", "999999*999999", "", "(1"]:
        assert calc.evaluate(bad) == "ERR", bad
    assert calc.evaluate("1+" * 40 + "1") == "ERR"


def test_tool_worker_latency_is_keyed_by_call_and_bounded() -> None:
    latency = ToolLatency(median_s=0.002, sigma=1.0, min_s=0.001, max_s=0.004)
    worker = ToolWorker(latency=latency, seed=5)
    draws = [worker.draw_latency(i) for i in range(200)]
    assert all(0.001 <= d <= 0.004 for d in draws)
    assert draws == [ToolWorker(latency=latency, seed=5).draw_latency(i) for i in range(200)]
    result = asyncio.run(worker.call("6*7", call_id=3))
    assert result.output == "42" and result.latency_s == draws[3]
    assert worker.num_calls == 1
    assert ToolWorker().call_now("1+1", call_id=0).latency_s == 0.0
