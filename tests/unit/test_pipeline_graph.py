"""A job's declared dataflow (``ComponentSpec.inputs``) reaches its scheduler as graph edges."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sched_support import PowerLawPredictor, report, stats_of

from dynarl.backends.reference import ReferenceInference
from dynarl.runtime import ComponentSpec, pipeline_graph
from dynarl.runtime.controller._controller import Controller
from dynarl.sched import SchedulerConfig, StaticMigrationCost
from dynarl.sched._decision import RoundInput
from dynarl.sched._planner import decide
from dynarl.sched._window import DonorSignal
from dynarl.testing import ScriptedRollout, TinyTrainer
from dynarl.types import Allocation, MigrationKind


def specs(**inputs: tuple[str, ...]) -> list[ComponentSpec]:
    return [
        ComponentSpec(role=ScriptedRollout, devices=(0,), inputs=inputs.get("rollout", ())),
        ComponentSpec(
            role=ReferenceInference, devices=(1,), min_devices=0,
            inputs=inputs.get("inference", ()), output="scores",
        ),
    ]  # fmt: skip


def test_each_input_is_an_edge_from_the_producer_over_its_output_channel() -> None:
    trainer = ComponentSpec(role=TinyTrainer, devices=(), inputs=("inference",))
    graph = pipeline_graph([*specs(inference=("rollout",)), trainer])
    assert graph.predecessors("inference") == ("rollout",)
    assert graph.successors("rollout") == ("inference",)
    assert graph.predecessors("trainer") == ("inference",)
    assert [(e.src, e.dst, e.channel) for e in graph.edges] == [
        ("inference", "trainer", "scores"),
        ("rollout", "inference", "rollout"),
    ]
    assert pipeline_graph(specs()).edges == ()


@pytest.mark.parametrize(
    ("inputs", "error"),
    [
        (("trainer",), r"'inference' has inputs \['trainer'\] that are not components"),
        (("inference",), "component 'inference' names itself"),
        (["rollout"], "must be a tuple of component names"),
        (("",), "must be a tuple of component names"),
    ],
)
def test_inputs_naming_no_other_component_are_refused(inputs: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        pipeline_graph(specs(inference=inputs))


def idle_scorer_round(graph_specs: list[ComponentSpec]) -> RoundInput:
    """The rollout works through its turns; the scorer idles, nothing handed to it yet."""
    config = SchedulerConfig()
    return RoundInput(
        nodes={node.name: node for node in pipeline_graph(graph_specs).components},
        allocation=Allocation.of({"rollout": (0,), "inference": (1,)}),
        stats=stats_of(
            report("rollout", remaining=100, queue_depth=20, utilization=(1.0,)),
            report("inference", kind="inference", remaining=0, utilization=(0.0,)),
            config=config,
        ),
        donors=(DonorSignal(component="inference", idle_fraction=1.0, mean_utilization=0.0),),
        predictor=PowerLawPredictor({"rollout": (5.0, 1.0, 8.0), "inference": (8.0, 1.0, 8.0)}),
        cost=StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 1.0}),
        config=config,
        time=10.0,
    )


@pytest.mark.parametrize(("inputs", "scorer_keeps"), [((), 0), (("rollout",), 1)])
def test_a_scorer_fed_by_the_rollout_keeps_its_device_while_turns_are_left(
    inputs: tuple[str, ...], scorer_keeps: int
) -> None:
    decision = decide(idle_scorer_round(specs(inference=inputs)))
    kept = decision.chosen.size("inference") if decision.committed and decision.chosen else 1
    assert kept == scorer_keeps, decision.reason


def test_a_job_hands_its_scheduler_the_declared_edges(tmp_path: Path) -> None:
    async def predecessors() -> dict[str, tuple[str, ...]]:
        async with (
            asyncio.timeout(60),
            Controller(specs(inference=("rollout",)), num_devices=2, run_dir=tmp_path) as ctl,
        ):
            return {name: node.predecessors for name, node in ctl.scheduler.nodes.items()}

    assert asyncio.run(predecessors()) == {"rollout": (), "inference": ("rollout",)}
    with pytest.raises(ValueError, match="not components of the job"):
        Controller(specs(rollout=("reward",)), num_devices=2, run_dir=tmp_path)
