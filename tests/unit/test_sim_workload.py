"""Workload files: parsing, validation, overrides, the shipped files and their derivation."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sim_support import WORKLOADS, shipped, small

from dynarl.sim import build_trace, dump_workload, load_workload, with_overrides
from dynarl.sim._workload_file import file_hash, workload_from_dict

HASHES = {
    "agentic-1.5b-128gpu": "aca5d257c0726578bba9940f74952a499b16987141614e8bbf9bc4ecdc0164c8",
    "agentic-1.5b-64gpu": "090765efaca78c45279650ae006fe83637f979804c1993596f6a2af5c2af7969",
    "agentic-32b-128gpu": "117a0e6323f296a23cb9fb9ef6a241c2b42968e5a9030021c0d9dd98891a8e14",
    "agentic-32b-64gpu": "a39c6abbd3413517286f47e71dcb7b2409aa9a464fbd96ae81381a33a067fd1b",
    "agentic-7b-128gpu": "db3ea70afc5e6e2ac4254eb7fe23df56722d62b2b58e930ce45d94940e562ab8",
    "agentic-7b-64gpu": "e5d3864fa45c4abbd8b536a996c3aefc04c9530cdf8292f07ab9b6c73c79040b",
    "math-1.5b-128gpu": "3d1f77dda0c8c9048275383cdcc7c4254aa287bc2a4a1a71880b7f993e9fe25d",
    "math-1.5b-64gpu": "d9ce7c415057c842f8f73d55f218750026ad14766ca22e31308a5fde6891c225",
    "math-32b-128gpu": "11bc2cb7c3f2ba794ec349aba8d32e5de433b05b6455b1fa06648875086b438e",
    "math-32b-64gpu": "755d94ab8b93289ac42f5cb8a2a98d4c6bdb376af05358adae87241e962bccf0",
    "math-7b-128gpu": "e119c9b06cb8ffb30fa0522f81f574799618aeb7695c2a89aa85fd398962d375",
    "math-7b-64gpu": "ca053669401aa0c3a14914d3ac089fa82b016681943aaf6b227ed88c3b009c28",
}
"""SHA-256 of every shipped workload file (regenerate with calibrate.py, then update)."""


def _calibrate() -> object:
    spec = importlib.util.spec_from_file_location("calibrate", WORKLOADS / "calibrate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["calibrate"] = module
    spec.loader.exec_module(module)
    return module


def test_every_shipped_workload_loads_and_is_pinned() -> None:
    files = sorted(WORKLOADS.glob("*.toml"))
    names = {f.stem for f in files}
    assert names == set(HASHES), "a shipped workload is not pinned (or a pin has no file)"
    for path in files:
        workload = load_workload(path)
        assert workload.name == path.stem
        assert file_hash(path) == HASHES[path.stem], f"{path.name} changed: recalibrate and re-pin"


def test_calibration_script_reproduces_the_shipped_files() -> None:
    calibrate = _calibrate()
    for size, gpus, kind in calibrate.SHIPPED:  # type: ignore[attr-defined]
        path = WORKLOADS / f"{kind}-{size}-{gpus}gpu.toml"
        assert calibrate.render(size, gpus, kind) == path.read_text(encoding="utf-8")  # type: ignore[attr-defined]


def test_calibration_holds_out_the_timeline_fact() -> None:
    calibrate = _calibrate()
    source = (WORKLOADS / "calibrate.py").read_text(encoding="utf-8")
    assert calibrate.FACTS["F10"][0] == "held out"  # type: ignore[attr-defined]
    assert source.count('"F10"') == 1, "the held-out fact must not be read by the derivation"


def test_fitted_decode_reproduces_facts_f1_to_f3() -> None:
    calibrate = _calibrate()
    longest, p95, left = calibrate.decode_facts(calibrate.FITTED)  # type: ignore[attr-defined]
    assert longest == pytest.approx(259.51, rel=0.02)
    assert p95 == pytest.approx(150.0, rel=0.02)
    assert left < 0.30


def test_dump_and_load_round_trip(tmp_path: Path) -> None:
    for name in ("math-7b-64gpu", "agentic-32b-128gpu"):
        workload = shipped(name)
        path = tmp_path / "w.toml"
        path.write_text(dump_workload(workload), encoding="utf-8")
        assert load_workload(path) == workload


def test_bad_input_names_the_key() -> None:
    data = tomllib.loads((WORKLOADS / "math-1.5b-64gpu.toml").read_text(encoding="utf-8"))
    data["rollout"]["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        workload_from_dict(data)
    data["rollout"].pop("bogus")
    data["rollout"]["tp"] = 3
    with pytest.raises(ValueError, match="tp"):
        workload_from_dict(data)
    data["rollout"]["tp"] = 1
    del data["trainer"]
    with pytest.raises(ValueError, match="trainer"):
        workload_from_dict(data)


def test_overrides_and_sweep_aliases() -> None:
    workload = shipped("math-1.5b-64gpu")
    changed = with_overrides(workload, {"u_low": 0.05, "t_window": 64.0, "seed": 3})
    assert changed.scheduler.util_low == 0.05
    assert changed.scheduler.donor_window_s == 64.0
    assert changed.scheduler.stats_window_s >= 64.0
    assert changed.seed == 3
    assert with_overrides(workload, {"rollout.tp": 2}).rollout.tp == 2
    with pytest.raises(ValueError, match="nope"):
        with_overrides(workload, {"scheduler.nope": 1})
    with pytest.raises(ValueError):
        with_overrides(workload, {"u_low": 2.0})


def test_trace_is_deterministic_and_per_iteration() -> None:
    workload = shipped("math-7b-64gpu")
    a, b = build_trace(workload, 1), build_trace(workload, 1)
    assert np.array_equal(a.output, b.output) and np.array_equal(a.prompt, b.prompt)
    assert not np.array_equal(a.output, build_trace(workload, 2).output)
    assert a.num_samples == 512 * 16
    assert (a.prompt + a.output <= workload.batch.max_seq_len).all()
    groups = a.group.reshape(512, 16)
    assert (groups == groups[:, :1]).all(), "a group's samples share one prompt"


def test_agentic_trace_respects_the_context_limit() -> None:
    workload = replace(small("agentic"), batch=replace(small("agentic").batch, max_seq_len=1500))
    trace = build_trace(workload, 0)
    for s in range(trace.num_samples):
        turns = slice(trace.turn_start[s], trace.turn_start[s + 1])
        context = trace.prompt[s] + np.cumsum(trace.output[turns] + trace.observation[turns])
        assert context[-1] <= workload.batch.max_seq_len
        assert trace.tool_latency[turns][-1] == 0 and trace.observation[turns][-1] == 0
    assert trace.num_turns.max() > 1
