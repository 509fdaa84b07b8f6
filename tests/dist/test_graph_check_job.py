"""A real job whose role code sends to a role it does not declare: the start-up graph
check warns once and records the finding in the ledger, and the job runs all the same."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import graph_roles
import pytest

import dynarl
from dynarl.sched import GraphFindingRecord, Ledger

pytestmark = pytest.mark.dist

TESTS = Path(graph_roles.__file__).parent


async def start_and_stop(run_dir: Path) -> list[GraphFindingRecord]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    config = dynarl.JobConfig(
        run_dir=str(run_dir),
        worker_env=env,
        runtime=dynarl.RuntimeConfig(metrics_port=None),
    )
    specs = [
        dynarl.ComponentSpec(role=graph_roles.Grader, devices=(0,)),
        dynarl.ComponentSpec(role=graph_roles.Idle, devices=()),
    ]
    async with dynarl.Job(specs, config) as job:
        assert job.allocation.devices("grader") == (0,)
        found = job.ledger.query(kind="graph")
    return [r for r in found if isinstance(r, GraphFindingRecord)]


def test_an_undeclared_channel_is_warned_about_and_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dynarl.runtime"):
        records = asyncio.run(start_and_stop(tmp_path))
    warnings = [r.getMessage() for r in caplog.records if "graph check" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "declares no component 'auditor'" in warnings[0]
    assert "'idle'" in warnings[1]
    undeclared, unused = records
    assert (undeclared.finding, undeclared.src, undeclared.dst, undeclared.channel) == (
        "undeclared",
        "grader",
        "auditor",
        "scores",
    )
    assert undeclared.component == "auditor"
    assert any(s.startswith(graph_roles.__file__) for s in undeclared.sites)
    assert (unused.finding, unused.component) == ("unused", "idle")
    assert Ledger.load(tmp_path / "events.jsonl").query(kind="graph") == records
