"""dynarl.testing's strategies draw valid values — and, fed to the real code, make it keep
its promises: the scheduler only ever commits valid allocations of the job's devices,
a request queue hands out every request once, layouts tile their tensors, small workloads
simulate."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from dynarl.migrate import Layout, plan_reshard
from dynarl.migrate._region import Shard
from dynarl.sched import (
    ComponentProfile,
    DynamicScheduleContext,
    HyperNode,
    ManualClock,
    MoveOutcome,
    ProfilePoint,
    QueuedRequest,
    RegressionPredictor,
    RequestQueue,
    Scheduler,
    SchedulerConfig,
    StaticMigrationCost,
    build_policy,
)
from dynarl.sim import Workload, run_policy
from dynarl.testing import (
    allocations,
    component_reports,
    layouts,
    pipelines,
    queued_requests,
    report_rounds,
    schedule_contexts,
    workloads,
)
from dynarl.types import Allocation, MigrationKind

NUM_DEVICES = 12


@st.composite
def jobs(draw: st.DrawFn) -> tuple[dict[str, HyperNode], Allocation, list[list[object]]]:
    nodes = draw(pipelines())
    allocation = draw(allocations(nodes, NUM_DEVICES))
    rounds = draw(report_rounds(allocation, nodes, num_rounds=6))
    return nodes, allocation, rounds  # type: ignore[return-value]


def valid(allocation: Allocation, nodes: dict[str, HyperNode]) -> bool:
    held = [d for _, devices in allocation.assignment for d in devices]
    return (
        len(held) == len(set(held))
        and set(held) <= set(range(NUM_DEVICES))
        and all(nodes[name].is_valid_size(allocation.count(name)) for name in nodes)
    )


@settings(max_examples=25)
@given(jobs())
def test_the_scheduler_commits_only_valid_allocations(
    job: tuple[dict[str, HyperNode], Allocation, list[list[object]]],
) -> None:
    nodes, allocation, rounds = job
    assert valid(allocation, nodes)
    profiles = {
        name: ComponentProfile(points=(ProfilePoint(num_devices=1, throughput=10.0),))
        for name in nodes
    }
    clock = ManualClock()
    scheduler = Scheduler(
        graph=nodes,
        allocation=allocation,
        predictor=RegressionPredictor(profiles),
        cost=StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 1.0, MigrationKind.P2P: 1.0}),
        clock=clock,
        config=SchedulerConfig(donor_window_s=1.0, min_move_interval_s=0.0, num_devices_per_node=4),
        free=[
            d
            for d in range(NUM_DEVICES)
            if d not in {x for _, ds in allocation.assignment for x in ds}
        ],
    )
    for reports in rounds:
        clock.time = reports[0].time  # type: ignore[attr-defined]
        for report in reports:
            for command in scheduler.handle(report):  # type: ignore[arg-type]
                assert valid(command.new_allocation, nodes)
                scheduler.handle(
                    MoveOutcome(
                        decision_id=command.decision_id, ok=True, allocation=command.new_allocation
                    )
                )
    assert len(scheduler.ledger.query(kind="decision")) >= 1


@given(component_reports("trainer", num_workers=3, time=5.0))
def test_reports_are_in_range(report: object) -> None:
    assert report.kind == "trainer" and len(report.utilization) == 3  # type: ignore[attr-defined]
    assert all(0.0 <= u <= 1.0 for u in report.utilization)  # type: ignore[attr-defined]
    assert report.throughput >= 0 and math.isfinite(report.throughput)  # type: ignore[attr-defined]


@given(queued_requests(), st.sampled_from(["priority", "fifo", "las"]))
def test_a_queue_hands_out_every_request_once(requests: list[QueuedRequest], name: str) -> None:
    from dynarl.sched import FifoPolicy, PriorityPolicy
    from dynarl.sched._requests import LeastAttainedServicePolicy

    policy = {
        "priority": PriorityPolicy(),
        "fifo": FifoPolicy(),
        "las": LeastAttainedServicePolicy(),
    }
    queue = RequestQueue(policy[name], max_overtakes=4)
    for request in requests:
        queue.push(request)
    popped = [queue.pop().request_id for _ in requests]
    assert sorted(popped) == sorted(r.request_id for r in requests)


@given(schedule_contexts())
def test_the_default_hybrid_policy_waits_for_at_most_one_cycle(ctx: DynamicScheduleContext) -> None:
    policy = build_policy("default")
    assert 0 <= policy.deactivate_wait_samples(ctx) <= ctx.step_required_samples
    policy.update_after_step(1, ctx)
    assert 0.0 <= policy.deactivate_ratio <= 1.0  # type: ignore[attr-defined]


@given(layouts())
def test_layouts_tile_every_tensor(layout: Layout) -> None:
    assert layout.spec is not None
    assert len(layout.ranks) == layout.spec.tp * layout.spec.pp * layout.spec.dp
    gather = max(layout.ranks) + 1
    whole = [Shard(tensor=t.name, rank=gather, region=t.full()) for t in layout.tensors]
    plan = plan_reshard(layout.tensor_map(), layout.shards, whole)
    moved = sum(item.region.numel for item in plan.items)
    assert moved == sum(math.prod(t.shape) for t in layout.tensors)


@settings(max_examples=5)
@given(workloads())
def test_small_workloads_simulate(workload: Workload) -> None:
    result = run_policy(workload, "dynarl")
    assert result.throughput > 0 and math.isfinite(result.throughput)
