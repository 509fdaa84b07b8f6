"""``dynarl simulate --sweep``: one table of every value, and one chart against the value.

The table has a row per swept value (and policy, when several ran) and the figures of the
per-run table, each speedup taken over the baseline run with the same value; ``--plot``
adds one chart of iteration time, throughput and the speedup over static-sequential
against the swept value, a tick at each value.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from sim_support import small

from dynarl import plots
from dynarl.cli import main
from dynarl.sim import dump_workload

matplotlib = pytest.importorskip("matplotlib")


@pytest.fixture
def workload_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(dump_workload(small()), encoding="utf-8")
    return path


def test_a_sweep_prints_one_table_with_a_row_per_value_and_policy(
    workload_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(workload_file), "--sweep", "u_low=0.1,0.3"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if "throughput (tokens/s)" in line]
    assert len(heads) == 1, out
    (head,) = heads
    assert head.split()[:2] == ["u_low", "policy"]
    for column in ("iter s", "moves/it", "migr %", "idle %", "vs static-sequential"):
        assert column in head
    rows = [line.split()[:2] for line in out.splitlines() if re.match(r"0\.[13] ", line)]
    assert rows == [
        ["0.1", "static-sequential"],
        ["0.1", "dynarl"],
        ["0.3", "static-sequential"],
        ["0.3", "dynarl"],
    ]
    assert re.search(r"highest throughput: u_low=0\.[13] \(", out)


def test_a_sweep_of_one_policy_has_a_row_per_value(
    workload_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", str(workload_file), "--policy", "dynarl", "--sweep", "seed=1,2,3"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    (head,) = [line for line in lines if "throughput (" in line]
    assert head.split()[:2] == ["seed", "throughput"]
    assert [line.split()[0] for line in lines if re.match(r"[123] ", line)] == ["1", "2", "3"]


def test_a_sweep_with_plot_draws_the_figures_against_the_value(
    workload_file: Path, tmp_path: Path, figures: list[Any]
) -> None:
    out = tmp_path / "plots"
    argv = ["simulate", str(workload_file), "--sweep", "u_low=0.1,0.3", "--plot", str(out)]
    assert main(argv) == 0
    assert (out / "small-math-sweep-u_low.png").read_bytes().startswith(b"\x89PNG")
    (chart,) = [f for f in figures if f.axes[-1].get_xlabel() == "u_low"]
    labels = [ax.get_ylabel() for ax in chart.axes]
    assert labels == [
        "iteration time (s)",
        "throughput (tokens/s)",
        "speedup over static-sequential (x)",
    ]
    assert list(chart.axes[-1].get_xticks()) == [0.1, 0.3]
    ratio = chart.axes[-1]
    assert [line.get_label() for line in ratio.get_lines() if line.get_label()[0] != "_"] == [
        "dynarl"
    ]
    chart.canvas.draw()
    legend = chart.axes[0].get_legend().get_window_extent()
    for ax in chart.axes:
        assert matplotlib.transforms.Bbox.intersection(legend, ax.get_window_extent()) is None


def test_a_sweep_chart_spaces_values_that_are_not_numbers_evenly(
    tmp_path: Path, figures: list[Any]
) -> None:
    plots.sweep_chart(
        tmp_path / "s.png",
        ["fifo", "priority"],
        {"throughput": {"dynarl": [1.0, 2.0]}},
        xlabel="policy",
    )
    (ax,) = figures[0].axes
    assert list(ax.get_xticks()) == [0.0, 1.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fifo", "priority"]
