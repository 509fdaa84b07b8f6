"""The fake and the adapter speak SGLang 0.5.23's schema: checked against the committed
snapshot (fast), and the snapshot against the pinned wheel itself (slow, downloads it)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import msgspec
import pytest
from aiohttp import web

from dynarl.backends.sglang import _http_wire as wire
from dynarl.testing.sglang_fake import _schema as schema
from dynarl.testing.sglang_fake._server import _ADMIN, FakeSGLangServer

SCHEMA_DIR = pathlib.Path(__file__).parents[1] / "sglang_schema"
SNAPSHOT = json.loads((SCHEMA_DIR / "sglang-0.5.23.json").read_text())
PINNED = "sglang==0.5.23"


def _fields(kind: type[msgspec.Struct]) -> dict[str, str]:
    """``{field: default}`` rendered as the extractor renders SGLang's."""
    out = {}
    for field in msgspec.structs.fields(kind):
        if field.default is not msgspec.NODEFAULT:
            out[field.name] = repr(field.default)
        elif field.default_factory is not msgspec.NODEFAULT:
            out[field.name] = repr(field.default_factory())
        else:
            out[field.name] = "<required>"
    return out


@pytest.mark.parametrize("name", sorted(SNAPSHOT["io_struct"]))
def test_fake_request_classes_have_exactly_sglangs_fields_and_defaults(name: str) -> None:
    assert _fields(getattr(schema, name)) == SNAPSHOT["io_struct"][name]


def test_fake_sampling_params_contract_matches_sglangs() -> None:
    assert {k: repr(v) for k, v in schema.SAMPLING_PARAMS_DEFAULTS.items()} == (
        SNAPSHOT["api_contract"]["SamplingParams"]
    )


def test_adapter_sends_only_fields_sglang_accepts_with_its_defaults() -> None:
    contract = SNAPSHOT["api_contract"]["SamplingParams"]
    for name, default in _fields(wire.SamplingParams).items():
        assert contract[name] == default, name
    accepted = SNAPSHOT["io_struct"]["GenerateReqInput"]
    for name, default in _fields(wire.GenerateRequest).items():
        assert name in accepted, name
        if name != "sampling_params":
            assert default in (accepted[name], "<required>"), name


@pytest.mark.parametrize("name", ["LoadSnapshot", "MemoryMetrics", "QueueMetrics"])
def test_adapter_reads_every_load_snapshot_field(name: str) -> None:
    ours = _fields(getattr(wire, name))
    theirs = SNAPSHOT["load_snapshot"][name]
    sections = {"speculative", "lora", "disaggregation"}
    assert set(ours) == set(theirs) - sections
    assert {k: v for k, v in ours.items()} == {k: theirs[k] for k in ours}


def _fake_routes() -> dict[str, set[str]]:
    app = web.Application()
    FakeSGLangServer()._routes(app)
    routes: dict[str, set[str]] = {}
    for route in app.router.routes():
        if route.method != "HEAD":
            routes.setdefault(route.resource.canonical, set()).add(route.method)
    return routes


def test_fake_serves_sglangs_routes_methods_and_auth_levels() -> None:
    fake = _fake_routes()
    assert set(fake) == set(SNAPSHOT["routes"])
    for path, info in SNAPSHOT["routes"].items():
        assert sorted(fake[path]) == info["methods"], path
        assert (path in _ADMIN) == (info["auth"] == "ADMIN_OPTIONAL"), path


def _extractor() -> Any:
    spec = importlib.util.spec_from_file_location("sglang_extract", SCHEMA_DIR / "extract.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pinned_wheel() -> pathlib.Path:
    """The pinned wheel from the cache, downloaded (without dependencies) if missing."""
    cache = pathlib.Path(
        os.environ.get("DYNARL_SGLANG_WHEEL_DIR", pathlib.Path.home() / ".cache/dynarl/sglang")
    )
    wheels = sorted(cache.glob("sglang-0.5.23-*.whl"))
    if wheels:
        return wheels[0]
    cache.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), PINNED],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    wheels = sorted(cache.glob("sglang-0.5.23-*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"cannot download {PINNED} (network unreachable?): {done.stderr[-300:]}")
    return wheels[0]


@pytest.mark.slow
def test_snapshot_matches_the_pinned_wheel() -> None:
    extracted = _extractor().extract_schema(_pinned_wheel())
    committed = {k: v for k, v in SNAPSHOT.items() if k != "wheel_sha256"}
    assert extracted == committed
