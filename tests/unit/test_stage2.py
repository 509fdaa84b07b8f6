"""Stage 2: candidate evaluation, the commit rule, and concrete device moves."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import pytest
from sched_support import NODES, ROLLOUT, TRAINER, PowerLawPredictor, report, stats_of

from dynarl.bus import Commit, FinishesLater, NotBetterAfterCost, Rejected, SavesLess
from dynarl.sched import (
    CostEstimate,
    HyperNode,
    Node,
    Resize,
    SchedulerConfig,
    StaticMigrationCost,
    place,
)
from dynarl.sched._decision import RoundInput
from dynarl.sched._planner import decide
from dynarl.sched._window import DonorSignal
from dynarl.types import Allocation, ComponentKind, MigrationKind

COST = StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 1.0, MigrationKind.P2P: 2.0})
TAIL_DONOR = DonorSignal(component="rollout", idle_fraction=1.0, mean_utilization=0.05)


def tail_stats() -> dict[str, object]:
    # Rollout is in its tail: 8 queries left, each device keeps 4 busy -> flat beyond ~2.
    return stats_of(
        report("rollout", remaining=8, utilization=(0.05,) * 12),
        report("trainer", kind="trainer", remaining=1000, queue_depth=50),
    )


def predictor() -> PowerLawPredictor:
    return PowerLawPredictor({"rollout": (100.0, 0.9, 4.0), "trainer": (10.0, 1.0, 0.0)})


def allocation() -> Allocation:
    return Allocation.of({"rollout": range(0, 12), "trainer": range(12, 16)})


def tail_round(**changes: Any) -> RoundInput:
    """Rollout (12 devices) idles in its tail beside a TP-2 trainer (4), 4 devices a node;
    ``changes`` replace any field."""
    scene = RoundInput(
        nodes=NODES,
        allocation=allocation(),
        stats=tail_stats(),
        donors=(TAIL_DONOR,),
        predictor=predictor(),
        cost=COST,
        config=SchedulerConfig(num_devices_per_node=4),
        time=10.0,
    )
    return replace(scene, **changes)


def test_tail_donor_gives_devices_to_the_trainer() -> None:
    decision = decide(tail_round())
    assert decision.committed, decision.reason
    chosen = decision.chosen
    assert chosen is not None and chosen.donor == "rollout"
    assert decision.reason == Commit(
        gain_s=chosen.gain_s, cost_s=chosen.cost_s, bottleneck=chosen.bottleneck
    )
    # Trainer reaches its largest valid size (16 devices) that rollout can free while
    # keeping its rate; rollout keeps the minimum 2 it needs (rate flat in n).
    assert chosen.size("trainer") in (8, 16) and chosen.size("rollout") >= 2
    assert decision.receivers == ("trainer",)
    assert chosen.gain_s > 0 and chosen.cost_s == 2.0
    assert chosen.remaining_s < decision.current.remaining_s
    assert decision.current.bottleneck == "trainer"
    new = decision.new_allocation()
    assert new.counts() == dict(chosen.sizes) | {n: new.count(n) for n in new.components}
    for name, n in chosen.sizes:
        assert new.count(name) == n
    trainer_devices = new.devices("trainer")
    groups = [trainer_devices[i : i + 2] for i in range(0, len(trainer_devices), 2)]
    assert all(g[0] // 4 == g[1] // 4 for g in groups), groups
    record = decision.to_record("d1")
    assert record.committed and record.new_allocation == dict(chosen.sizes)
    assert record.expected_gain_s == chosen.gain_s and record.migration_cost_s == 2.0
    assert record.reason == decision.reason
    assert all(isinstance(r.reason, SavesLess) for r in record.rejected)


def test_not_committed_when_the_cost_eats_the_gain() -> None:
    expensive = StaticMigrationCost(seconds={MigrationKind.P2P: 1e6, MigrationKind.WORKLOAD: 1e6})
    decision = decide(tail_round(cost=expensive))
    assert not decision.committed and decision.moves == ()
    assert decision.rejected
    assert decision.reason == Rejected(why=decision.rejected[0].reason)
    best = decision.rejected[0].candidate
    assert decision.rejected[0].reason == NotBetterAfterCost(
        gain_s=best.gain_s, cost_s=1e6, min_gain_s=0.0
    )
    assert str(decision.reason) == (
        f"rejected: not better after cost: saves {best.gain_s:.3f} s net of 1000000.000 s "
        "migration, needs more than 0.0 s"
    )
    assert all(isinstance(r.reason, NotBetterAfterCost) for r in decision.rejected)
    assert decision.new_allocation() == allocation()


def test_peak_memory_limits_the_trainer_growth() -> None:
    # One replica's state is 60 GiB over tp=2 -> 30 GiB per device at dp=1; with an 80 GiB
    # device, growing to dp=2 (old 30 + new 30 = 60) fits, but only when the sharded part
    # keeps the new copy small enough. 100% replicated: old + new <= 80 always holds here,
    # so shrink the device to 50 GiB: 30 + 30 > 50 -> no trainer growth is feasible.
    heavy = replace(TRAINER, state_bytes=60 << 30)
    config = SchedulerConfig(num_devices_per_node=4, device_memory_bytes=50 << 30)
    nodes = {"rollout": ROLLOUT, "trainer": heavy}
    assert not decide(tail_round(nodes=nodes, config=config)).committed
    roomy = SchedulerConfig(num_devices_per_node=4, device_memory_bytes=80 << 30)
    assert decide(tail_round(nodes=nodes, config=roomy)).committed


def test_free_devices_alone_are_handed_out() -> None:
    decision = decide(
        tail_round(
            allocation=Allocation.of({"rollout": range(0, 4), "trainer": range(4, 8)}),
            free=tuple(range(8, 16)),
            donors=(),
            config=SchedulerConfig(num_devices_per_node=8),
        )
    )
    assert decision.committed and decision.chosen is not None
    assert decision.chosen.donor is None
    # Valid trainer sizes are 2, 4, 8, 16: with 4 held and 8 free, 8 is the most it gets.
    assert decision.chosen.size("trainer") == 8 and decision.chosen.num_free == 4
    assert all(m.src is None for m in decision.moves)


def test_component_without_devices_and_with_work_gets_some() -> None:
    decision = decide(
        tail_round(
            allocation=Allocation.of({"rollout": range(0, 16)}),
            config=SchedulerConfig(num_devices_per_node=8, min_gain_s=1.0),
        )
    )
    assert math.isinf(decision.current.remaining_s)
    assert decision.committed and decision.chosen is not None
    assert decision.chosen.size("trainer") > 0
    assert str(decision.reason).startswith("commit: saves all remaining work net of ")


def test_placement_keeps_tp_groups_node_local_and_is_deterministic() -> None:
    alloc = Allocation.of({"a": [0, 1, 2, 5, 6, 9], "b": [3, 4, 7, 8, 10, 11]})
    nodes = {
        "a": HyperNode(name="a", kind=ComponentKind.ROLLOUT),
        "b": HyperNode(name="b", kind=ComponentKind.TRAINER, tp=2),
    }
    moves = place(alloc, (), {"a": 4, "b": 8}, nodes, devices_per_node=4)
    assert moves == place(alloc, (), {"a": 4, "b": 8}, nodes, devices_per_node=4)
    (move,) = moves
    assert move.src == "a" and move.dst == "b" and len(move.devices) == 2
    assert move.devices[0] // 4 == move.devices[1] // 4
    # 'a' holds one device on node 2 (device 9) and two on node 0 and on node 1; to give
    # 'b' a node-local pair it must release two devices of one node.
    moves = place(alloc, (), {"a": 2, "b": 10}, nodes, devices_per_node=4)
    got = sorted(d for m in moves for d in m.devices)
    pairs = [got[i : i + 2] for i in range(0, len(got), 2)]
    assert all(p[0] // 4 == p[1] // 4 for p in pairs)


def test_placement_refuses_fragmented_tp_groups() -> None:
    from dynarl.errors import SchedulingError

    alloc = Allocation.of({"a": [0, 4], "b": [1, 2, 3, 5, 6, 7]})
    nodes = {
        "a": HyperNode(name="a", kind=ComponentKind.ROLLOUT),
        "b": HyperNode(name="b", kind=ComponentKind.TRAINER, tp=2),
    }
    with pytest.raises(SchedulingError, match="inside single nodes"):
        place(alloc, (), {"a": 0, "b": 8}, nodes, devices_per_node=4)


def test_static_cost_model() -> None:
    resizes = (
        Resize(
            component="t",
            migration=MigrationKind.P2P,
            old_devices=2,
            new_devices=6,
            tp=2,
            state_bytes=100,
        ),
        Resize(component="r", migration=MigrationKind.WORKLOAD, old_devices=8, new_devices=4),
    )
    assert COST.estimate(resizes) == CostEstimate(seconds=2.0, bytes=200)
    assert COST.estimate(()) == CostEstimate(seconds=0.0, bytes=0)


def _rollout_with_workers(tp: int, loads: dict[tuple[int, ...], float]) -> HyperNode:
    workers = tuple(
        Node(worker=i, devices=devs, utilization=u) for i, (devs, u) in enumerate(loads.items())
    )
    return HyperNode(name="a", kind=ComponentKind.ROLLOUT, tp=tp, workers=workers)


def test_placement_releases_the_least_utilized_registered_workers() -> None:
    # Engines of two devices on two 4-device nodes; the receiver needs one pair.
    loads = {(0, 1): 0.30, (2, 3): 0.05, (4, 5): 0.10, (6, 7): 0.20}
    nodes = {
        "a": _rollout_with_workers(2, loads),
        "b": HyperNode(name="b", kind=ComponentKind.TRAINER, tp=2),
    }
    alloc = Allocation.of({"a": range(8), "b": range(8, 12)})
    (move,) = place(alloc, (), {"a": 6, "b": 6}, nodes, devices_per_node=4)
    assert move.devices == (2, 3)
    # The per-worker loads of a report (worker order) take precedence over the registry's.
    (move,) = place(
        alloc, (), {"a": 6, "b": 6}, nodes, devices_per_node=4, load={"a": (0.0, 0.5, 0.5, 0.5)}
    )
    assert move.devices == (0, 1)


def test_placement_releases_whole_blocks_by_their_total_load() -> None:
    # The receiver's TP is 4: it needs two engines of one node. Node 1's pair costs
    # 0.10 + 0.20, node 0's 0.05 + 0.30; the cheaper block goes even though node 0 holds
    # the least loaded single engine.
    loads = {(0, 1): 0.30, (2, 3): 0.05, (4, 5): 0.10, (6, 7): 0.20}
    nodes = {
        "a": _rollout_with_workers(2, loads),
        "b": HyperNode(name="b", kind=ComponentKind.TRAINER, tp=4),
    }
    alloc = Allocation.of({"a": range(8), "b": range(8, 12)})
    (move,) = place(alloc, (), {"a": 4, "b": 8}, nodes, devices_per_node=4)
    assert move.devices == (4, 5, 6, 7)


def test_placement_falls_back_to_topology_when_workers_do_not_match() -> None:
    # Registered workers that do not cover the held devices (stale) are ignored.
    stale = _rollout_with_workers(2, {(0, 1): 0.9, (2, 3): 0.0})
    nodes = {"a": stale, "b": HyperNode(name="b", kind=ComponentKind.TRAINER, tp=2)}
    alloc = Allocation.of({"a": range(8), "b": range(8, 12)})
    plain = {"a": HyperNode(name="a", kind=ComponentKind.ROLLOUT, tp=2), "b": nodes["b"]}
    expected = place(alloc, (), {"a": 6, "b": 6}, plain, devices_per_node=4)
    assert place(alloc, (), {"a": 6, "b": 6}, nodes, devices_per_node=4) == expected


def _pipeline_stats(rollout_remaining: int) -> dict[str, object]:
    return stats_of(
        report("rollout", remaining=rollout_remaining, utilization=(0.9,) * 8),
        report("inference", kind="inference", utilization=(0.0,) * 2, remaining=0),
        report("trainer", kind="trainer", remaining=500, queue_depth=500, utilization=(1.0,) * 2),
    )


@pytest.mark.parametrize(("upstream", "floor"), [(100, 2), (0, 0)])
def test_a_donor_keeps_one_replica_while_its_inputs_are_still_coming(
    upstream: int, floor: int
) -> None:
    nodes = {
        "rollout": HyperNode(name="rollout", kind=ComponentKind.ROLLOUT, successors=("inference",)),
        "inference": HyperNode(
            name="inference",
            kind=ComponentKind.INFERENCE,
            tp=2,
            predecessors=("rollout",),
            successors=("trainer",),
        ),
        "trainer": HyperNode(
            name="trainer",
            kind=ComponentKind.TRAINER,
            migration=MigrationKind.P2P,
            tp=2,
            min_devices=2,
            predecessors=("inference",),
        ),
    }
    alloc = Allocation.of({"rollout": range(8), "inference": range(8, 12), "trainer": (12, 13)})
    decision = decide(
        tail_round(
            nodes=nodes,
            allocation=alloc,
            stats=_pipeline_stats(upstream),
            donors=(DonorSignal(component="inference", idle_fraction=1.0, mean_utilization=0.0),),
            predictor=PowerLawPredictor(
                {
                    "rollout": (10.0, 1.0, 0.0),
                    "inference": (50.0, 1.0, 0.0),
                    "trainer": (1.0, 1.0, 0.0),
                }
            ),
            config=SchedulerConfig(num_devices_per_node=16),
        )
    )
    assert decision.committed and decision.chosen is not None
    # Idle with nothing queued, inference never limits; the trainer takes what it frees,
    # all of it only once nothing more can come from rollout.
    assert decision.chosen.size("inference") == floor
    assert decision.chosen.size("trainer") == 14 - 8 - floor


PARKABLE = replace(TRAINER, parkable=True, predecessors=("rollout",))


@dataclass(frozen=True)
class PerDeviceCost:
    """Seconds per device a move adds somewhere (a cost that grows with the move)."""

    seconds_per_device: float

    def estimate(self, resizes: tuple[Resize, ...]) -> CostEstimate:
        added = sum(max(0, r.new_devices - r.old_devices) for r in resizes)
        return CostEstimate(seconds=self.seconds_per_device * added, bytes=0)


def test_a_stalled_pipeline_ranks_its_ways_out_by_finish_time_not_by_an_infinite_gain() -> None:
    # The trainer is parked with 1000 items queued: the current allocation never finishes.
    decision = decide(
        tail_round(
            nodes={"rollout": ROLLOUT, "trainer": PARKABLE},
            allocation=Allocation.of({"rollout": range(0, 16)}),
            cost=PerDeviceCost(4.0),
            config=SchedulerConfig(num_devices_per_node=8),
        )
    )
    assert math.isinf(decision.current.remaining_s)
    assert decision.committed and decision.chosen is not None
    ranked = [decision.chosen, *(r.candidate for r in decision.rejected)]
    finish = [c.remaining_s + c.cost_s for c in ranked]
    assert all(math.isfinite(f) for f in finish) and finish == sorted(finish)
    # 10 items/s a device: 2 -> 50 s + 8 s, 4 -> 25 s + 16 s, 8 -> 12.5 s + 32 s. The
    # fastest trainer (8) is not the earliest finish once its move is paid for.
    assert {c.size("trainer") for c in ranked} == {2, 4, 8}
    assert decision.chosen.size("trainer") == 4
    assert decision.chosen.remaining_s + decision.chosen.cost_s == pytest.approx(41.0)
    chosen_finish = decision.chosen.remaining_s + decision.chosen.cost_s
    assert [r.reason for r in decision.rejected] == [
        FinishesLater(finish_s=f, chosen_finish_s=chosen_finish) for f in finish[1:]
    ]


def test_a_parked_component_with_nothing_queued_is_no_reason_to_move() -> None:
    # Rollout still generates (its inputs keep the trainer's queue empty for now).
    nodes = {"rollout": ROLLOUT, "trainer": PARKABLE}
    stats = stats_of(
        report("rollout", remaining=400, utilization=(0.05,) * 16),
        report("trainer", kind="trainer", remaining=0, queue_depth=0, utilization=()),
    )
    decision = decide(
        tail_round(
            nodes=nodes,
            allocation=Allocation.of({"rollout": range(0, 16)}),
            stats=stats,
            config=SchedulerConfig(num_devices_per_node=8),
        )
    )
    assert math.isfinite(decision.current.remaining_s)
    assert decision.current.bottleneck == "rollout"
    assert not decision.committed
    assert all(r.candidate.size("trainer") == 0 for r in decision.rejected)


def test_a_donor_keeps_what_its_receivers_do_not_take() -> None:
    # A 100-device rollout in its tail, its ladder thinned to 4 sizes: the donor keeps
    # exactly what is left after the trainer's growth, not the next thinned size below it
    # (which left 85 devices free and no component growing onto them).
    stats = stats_of(
        report("rollout", remaining=8, utilization=(0.05,) * 100),
        report("trainer", kind="trainer", remaining=1000, queue_depth=50),
    )
    inputs = tail_round(
        allocation=Allocation.of({"rollout": range(100), "trainer": range(100, 104)}),
        stats=stats,
        config=SchedulerConfig(num_devices_per_node=4, num_size_points=4),
    )
    decision = decide(inputs)
    assert decision.committed and decision.chosen is not None
    assert decision.chosen.size("trainer") > 4
    candidates = [decision.chosen, *(r.candidate for r in decision.rejected)]
    assert all(c.num_free == 0 for c in candidates)
    assert decision.chosen.size("rollout") == 104 - decision.chosen.size("trainer")


def test_a_finished_component_may_park_and_one_with_items_left_keeps_a_replica() -> None:
    # Rollout's 4-device engines beside a TP-8 trainer, 8 devices a node. Done, rollout
    # gives up its last engine too: half a node is of no use to the trainer.
    nodes = {
        "rollout": HyperNode(name="rollout", kind=ComponentKind.ROLLOUT, tp=4, parkable=True),
        "trainer": replace(TRAINER, tp=8, dp_sizes=(), min_devices=8),
    }
    idle = DonorSignal(component="rollout", idle_fraction=1.0, mean_utilization=0.0)

    def round_with(remaining: int) -> RoundInput:
        return tail_round(
            nodes=nodes,
            allocation=Allocation.of({"rollout": range(0, 8), "trainer": range(8, 16)}),
            stats=stats_of(
                report("rollout", remaining=remaining, utilization=(0.0, 0.0)),
                report("trainer", kind="trainer", remaining=1000, queue_depth=50),
            ),
            donors=(idle,),
            config=SchedulerConfig(num_devices_per_node=8),
        )

    done = decide(round_with(0))
    assert done.committed and done.chosen is not None
    assert done.chosen.size("rollout") == 0 and done.chosen.size("trainer") == 16
    working = decide(round_with(8))
    sizes = [r.candidate.size("rollout") for r in working.rejected]
    assert working.chosen is None or working.chosen.size("rollout") > 0
    assert all(n > 0 for n in sizes)


@pytest.mark.parametrize("held", ["rollout", "trainer"])
def test_a_held_component_is_neither_shrunk_nor_grown(held: str) -> None:
    assert decide(tail_round()).committed
    decision = decide(tail_round(held=frozenset({held})))
    assert not decision.committed and decision.moves == ()
    assert all(r.candidate.size(held) == allocation().count(held) for r in decision.rejected)
