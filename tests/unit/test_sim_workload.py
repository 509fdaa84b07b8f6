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

from dynarl.sim import build_trace, dump_workload, file_hash, load_workload, with_overrides
from dynarl.sim.workload import workload_from_dict

HASHES = {
    "agentic-1.5b-128gpu": "d2d8233e0e7c998012666115a2bb188a12662777bb7936274e97f0ad16cd4cce",
    "agentic-1.5b-64gpu": "663ffa884d5296cbea1973e7ccd3db3ecb57727223e72bca16c465f32755ca67",
    "agentic-32b-128gpu": "18561d126365c30050ad7a89741134f3a1194be7fd67139d79d4f08465a23452",
    "agentic-32b-64gpu": "012ead57c7d6d2db060d28328f141374c38dabf7816e731f06cc0822efd8bd8f",
    "agentic-7b-128gpu": "4713e6eba732b77cc65ce3599a2e789d8da7b1d77bacc35dd8aa24b0be455678",
    "agentic-7b-64gpu": "52bfad90f9ff195240e3af2cf80313624718837bfd84821c05d114f481e22620",
    "math-1.5b-128gpu": "d0202179cbfe8e8310cc088698feee78e095efbfaa01a2c4a82fa13ae4cbb206",
    "math-1.5b-64gpu": "8172d4bd4d82d2b4040d1d8f5f7437b461c2265b0e3cfbf5ff91de3c52c06d3d",
    "math-32b-128gpu": "42db4148aa060858a4208a60aa5259d7b7ebb03a87e6f9972f6209ccc342d3cc",
    "math-32b-64gpu": "74a7c41736049618dc7cade588d6b09b779221806f11bcc9158f02e28c7b2b78",
    "math-7b-128gpu": "386ae4f9465d8b0f00619d55edff686e7685d0645d5007f9ec2989910348ca5c",
    "math-7b-64gpu": "128f62356ec30e26f0dfc8a327b84f16995861a6514e8aff6e72f76681220e32",
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
