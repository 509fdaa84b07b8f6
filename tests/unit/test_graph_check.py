"""The start-up graph check: declared components against the graph extracted from code."""

from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path

import graph_roles
import pytest

from dynarl import WorkerGroup
from dynarl.runtime import ComponentSpec
from dynarl.runtime._graph_check import (
    DeclaredComponent,
    GraphFinding,
    RoleGraph,
    check_graph,
    check_roles,
    read_role_graph,
)
from dynarl.sched import (
    GraphFindingRecord,
    Ledger,
    extract_graph,
    format_summary,
    summarise_ledger,
    summary_json,
)
from dynarl.types import ComponentKind

HEADER = textwrap.dedent(
    """
    from dynarl import Channel, WorkerGroup

    SAMPLES = Channel("samples")
    SCORES = Channel("scores")
    """
)
PIPELINE = HEADER + textwrap.dedent(
    """
    class Rollout(WorkerGroup):
        async def run(self):
            await SAMPLES.put(1)

    class Reward(WorkerGroup):
        async def run(self):
            await SCORES.put(await SAMPLES.get())

    class Trainer(WorkerGroup):
        async def run(self):
            await SCORES.get()
    """
)
CRITIC = "class Critic(WorkerGroup):\n    async def run(self):\n        return 0\n"
CODE = RoleGraph(graph=extract_graph(PIPELINE + CRITIC))


def declared(*names: str) -> list[DeclaredComponent]:
    return [DeclaredComponent(name=name) for name in names]


def kinds(findings: tuple[GraphFinding, ...]) -> set[tuple[str, str]]:
    return {(f.finding, f.component) for f in findings}


def test_a_clean_graph_gives_no_findings() -> None:
    check = check_graph(
        declared("Rollout", "Reward", "Trainer"), RoleGraph(graph=extract_graph(PIPELINE))
    )
    assert check.findings == () and check.skipped == () and check.num_unresolved == 0


def test_an_undeclared_channel_is_found_from_both_of_its_ends() -> None:
    check = check_graph(declared("Rollout", "Trainer", "Critic"), CODE)
    undeclared = [f for f in check.findings if f.finding == "undeclared"]
    assert [(f.src, f.dst, f.channel, f.component) for f in undeclared] == [
        ("Reward", "Trainer", "scores", "Reward"),
        ("Rollout", "Reward", "samples", "Reward"),
    ]
    assert all(f.sites for f in undeclared)
    assert "declares no component 'Reward'" in str(undeclared[0])


def test_an_unused_declared_component_is_found_and_an_unread_one_is_not_judged() -> None:
    check = check_graph(declared("Rollout", "Reward", "Trainer", "Critic", "Ghost"), CODE)
    (finding,) = check.findings
    assert (finding.finding, finding.component) == ("unused", "Critic")
    line = (PIPELINE + CRITIC).splitlines().index("class Critic(WorkerGroup):") + 1
    assert finding.sites == (f"<source>:{line}",)


def test_edges_between_undeclared_roles_are_not_the_jobs() -> None:
    check = check_graph(declared("Trainer"), CODE)
    assert [(f.src, f.dst) for f in check.findings] == [("Reward", "Trainer")]


def test_a_pipeline_without_channels_between_its_roles_has_no_unused_component() -> None:
    loop_driven = RoleGraph(graph=extract_graph(HEADER + CRITIC + CRITIC.replace("Critic", "B")))
    assert check_graph(declared("Critic", "B"), loop_driven).findings == ()


def test_a_declared_output_channel_is_an_edge_of_its_serving_component() -> None:
    code = RoleGraph(
        graph=extract_graph(PIPELINE.replace("await SAMPLES.put(1)", "return 1")),
        names={"Rollout": "rollout"},
    )
    served = DeclaredComponent(name="rollout", output="samples")
    assert check_graph([served, *declared("Reward", "Trainer")], code).findings == ()
    check = check_graph([DeclaredComponent(name="rollout"), *declared("Reward", "Trainer")], code)
    assert kinds(check.findings) == {("unused", "rollout")}


def test_nothing_read_gives_no_findings() -> None:
    check = check_graph(declared("Rollout"), RoleGraph(graph=None, skipped=("m: OSError",)))
    assert check.findings == () and check.skipped == ("m: OSError",)


def test_role_modules_are_read_under_the_runtime_names_and_a_broken_one_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "broken_roles.py"
    broken.write_text("class Oops(:\n")
    module = types.ModuleType("broken_roles")
    module.__file__ = str(broken)
    monkeypatch.setitem(sys.modules, "broken_roles", module)
    ns = {"__module__": "broken_roles"}
    oops = types.new_class(
        "Oops", (WorkerGroup,), {"kind": ComponentKind.TOOL}, lambda d: d.update(ns)
    )
    code = read_role_graph([graph_roles.Grader, oops])
    assert [s.split(":")[0] for s in code.skipped] == ["broken_roles"]
    assert code.names == {"Auditor": "auditor", "Grader": "grader", "Idle": "idle"}
    check = check_roles(
        [
            ComponentSpec(role=graph_roles.Grader, devices=(0,)),
            ComponentSpec(role=graph_roles.Idle, devices=()),
            ComponentSpec(role=oops, devices=()),
        ]
    )
    assert kinds(check.findings) == {("undeclared", "auditor"), ("unused", "idle")}
    assert all(s.startswith(graph_roles.__file__) for f in check.findings for s in f.sites)
    assert check.skipped == code.skipped


def test_a_finding_round_trips_through_the_ledger_file_and_the_summary(tmp_path: Path) -> None:
    finding = GraphFinding(
        finding="undeclared", component="auditor", src="grader", dst="auditor",
        channel="scores", sites=("roles.py:3",),
    )  # fmt: skip
    with Ledger(tmp_path / "events.jsonl") as ledger:
        ledger.append(finding.record("g000001", 5.0))
        ledger.append(GraphFinding(finding="unused", component="idle").record("g000002", 5.0))
    loaded = Ledger.load(tmp_path / "events.jsonl")
    records = loaded.query(kind="graph")
    assert records == [finding.record("g000001", 5.0), GraphFindingRecord(
        record_id="g000002", time=5.0, finding="unused", component="idle"
    )]  # fmt: skip
    assert loaded.query(component="grader") == records[:1]
    assert loaded.get("g000002", kind="graph") == records[1]
    summary = summarise_ledger(loaded)  # what `dynarl events` prints
    assert summary.num_records == 2 and summary.num_rounds == 0
    assert format_summary(summary, source="events.jsonl")
    assert summary_json(summary, source="events.jsonl")
