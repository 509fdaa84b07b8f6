"""``bench/priority.py`` refuses bad arguments with a message naming the argument, before it
starts a server or writes anything."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports its sibling modules
    spec = importlib.util.spec_from_file_location("bench_priority_args", BENCH / "priority.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv", "0"], "argument --kv/--kv-blocks: expected at least 1, got 0"),
        (["--reps", "-2"], "argument --reps: expected at least 1, got -2"),
        (["--episodes", "many"], "argument --episodes: expected a whole number, got 'many'"),
        (["--engine", "tgi"], "argument --engine: invalid choice: 'tgi'"),
    ],
)
def test_a_bad_argument_is_refused_by_name(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_bench(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
