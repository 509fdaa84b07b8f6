"""``dynarl simulate``: the table, the JSON document, sweeps, plots, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_support import small

from dynarl.cli import main
from dynarl.sim import dump_workload

POLICIES = ("static-sequential", "dynarl", "policies")
"""What a sweep draws per value: a timeline per policy it runs, and them side by side."""


@pytest.fixture
def workload_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(dump_workload(small()), encoding="utf-8")
    return path


def test_table_has_every_policy_and_the_speedups(
    workload_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(workload_file)]) == 0
    out = capsys.readouterr().out
    for name in ("static-sequential", "static-split", "rlinf-rule", "verl-hybrid", "dynarl"):
        assert name in out
    assert "vs static-sequential" in out and "throughput (tokens/s)" in out
    assert "idle %" in out and "migr %" in out


def test_json_document(workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", str(workload_file), "--policy", "static-split,dynarl", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in doc["policies"]] == ["static-split", "dynarl"]
    for record in doc["policies"]:
        assert {"policy", "throughput", "iteration_s", "moves", "idle_share"} <= set(record)
    ratio = doc["policies"][1]["throughput"] / doc["policies"][0]["throughput"]
    assert doc["speedups"]["dynarl"]["static-split"] == pytest.approx(ratio)


def test_sweep_and_plots(
    workload_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plots = tmp_path / "plots"
    code = main(
        ["simulate", str(workload_file), "--sweep", "u_low=0.1,0.3", "--json", "--plot", str(plots)]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sweep"] == "u_low" and [run["value"] for run in doc["runs"]] == [0.1, 0.3]
    for run in doc["runs"]:
        assert [r["policy"] for r in run["policies"]] == ["static-sequential", "dynarl"]
    pngs = {p.name for p in plots.glob("*.png")}
    timelines = {f"small-math-u_low_{v}-{p}.png" for v in ("0.1", "0.3") for p in POLICIES}
    assert pngs == {"small-math-sweep-u_low.png", *timelines}
    assert all((plots / p).read_bytes().startswith(b"\x89PNG") for p in pngs)


def test_bad_input_is_reported(workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(workload_file), "--policy", "nope"]) == 2
    assert main(["simulate", str(workload_file), "--sweep", "scheduler.bogus=1"]) == 2
    assert main(["simulate", str(workload_file.parent / "missing.toml")]) == 2
    assert "dynarl simulate" in capsys.readouterr().err
