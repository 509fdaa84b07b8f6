"""The hypergraph: registration, edges and progress, and a hypernode's resizing rules."""

from __future__ import annotations

import pytest

from dynarl.sched import Affinity, HyperEdge, Hypergraph, HyperNode, Node
from dynarl.types import ComponentKind, MigrationKind


def trainer(**kw: object) -> HyperNode:
    values: dict[str, object] = {"name": "trainer", "kind": ComponentKind.TRAINER, "tp": 2, "pp": 2}
    values.update(kw)
    return HyperNode(**values)  # type: ignore[arg-type]


def test_registration_links_edges_and_workers() -> None:
    graph = Hypergraph.of(
        [
            HyperNode(name="rollout", kind=ComponentKind.ROLLOUT),
            HyperNode(name="reward", kind=ComponentKind.REWARD),
            trainer(),
        ],
        [HyperEdge(src="rollout", dst="reward", channel="samples", affinity=Affinity.PREFER)],
    )
    graph.connect(HyperEdge(src="reward", dst="trainer", channel="scored"))
    graph.connect(HyperEdge(src="rollout", dst="trainer", channel="raw"))
    assert graph.successors("rollout") == ("reward", "trainer")
    assert graph.predecessors("trainer") == ("reward", "rollout")
    graph.register_worker("rollout", Node(worker=1, devices=(5,)))
    graph.register_worker("rollout", Node(worker=0, devices=(4,), utilization=0.3))
    graph.register_worker("rollout", Node(worker=1, devices=(6,)))  # replaced
    graph.update_utilization("rollout", {1: 0.9})
    rollout = graph.component("rollout")
    assert [(w.worker, w.devices, w.utilization) for w in rollout.workers] == [
        (0, (4,), 0.3),
        (1, (6,), 0.9),
    ]
    assert rollout.num_devices == 2
    graph.unregister_worker("rollout", 0)
    assert graph.component("rollout").num_devices == 1
    edge = graph.record_progress("rollout", "reward", "samples", produced=10, consumed=4)
    assert edge.progress == 0.4 and edge.affinity is Affinity.PREFER
    graph.reset_progress()
    assert graph.edges[1].progress == 1.0
    assert "trainer" in graph and "critic" not in graph


def test_registration_errors_name_the_problem() -> None:
    graph = Hypergraph.of([HyperNode(name="a", kind=ComponentKind.TOOL)])
    with pytest.raises(ValueError, match="already registered"):
        graph.add_component(HyperNode(name="a", kind=ComponentKind.TOOL))
    with pytest.raises(ValueError, match="unknown component 'b'"):
        graph.connect(HyperEdge(src="a", dst="b", channel="x"))
    with pytest.raises(ValueError, match="no edge a->a"):
        graph.record_progress("a", "a", "x", produced=1)
    with pytest.raises(ValueError, match="unknown component 'z'"):
        graph.component("z")


def test_edges_registered_before_a_component_link_when_it_arrives() -> None:
    graph = Hypergraph.of(
        [HyperNode(name="a", kind=ComponentKind.TOOL), HyperNode(name="b", kind=ComponentKind.TOOL)]
    )
    graph.connect(HyperEdge(src="a", dst="b", channel="x"))
    assert graph.component("b").predecessors == ("a",)


def test_valid_sizes_respect_unit_dp_sizes_and_bounds() -> None:
    node = trainer(dp_sizes=(1, 2, 4, 8), min_devices=4, max_devices=24)
    assert node.unit == 4
    assert [n for n in range(0, 40) if node.is_valid_size(n)] == [4, 8, 16]
    assert node.valid_sizes(0, 100, 64) == (4, 8, 16)
    assert node.num_valid_sizes(0, 100) == 3
    free = HyperNode(name="r", kind=ComponentKind.ROLLOUT)
    assert free.is_valid_size(0) and free.valid_sizes(0, 3, 64) == (0, 1, 2, 3)
    many = free.valid_sizes(0, 100_000, 16)
    assert len(many) <= 17 and many[0] == 0 and many[1] == 1 and many[-1] == 100_000
    assert free.num_valid_sizes(0, 100_000) == 100_001


@pytest.mark.parametrize("low", [0, 1, 4, 9])
@pytest.mark.parametrize("high", [0, 3, 8, 24, 100])
def test_a_parkable_node_may_hold_zero_and_its_size_views_agree(low: int, high: int) -> None:
    parked = trainer(dp_sizes=(1, 2, 4, 8), min_devices=8, max_devices=24, parkable=True)
    fixed = trainer(dp_sizes=(1, 2, 4, 8), min_devices=8, max_devices=24)
    valid = [n for n in range(low, high + 1) if parked.is_valid_size(n)]
    assert valid == [n for n in (0, 8, 16) if low <= n <= high]
    assert list(parked.valid_sizes(low, high, 64)) == valid
    assert parked.num_valid_sizes(low, high) == len(valid)
    # Without parking only the minimum and above; 0 (or anything in between) never.
    assert [n for n in range(low, high + 1) if fixed.is_valid_size(n)] == [n for n in valid if n]
    assert list(fixed.valid_sizes(low, high, 64)) == [n for n in valid if n]
    assert fixed.num_valid_sizes(low, high) == len([n for n in valid if n])
    assert not parked.is_valid_size(4) and parked.zero_allowed and not fixed.zero_allowed


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"min_devices": 2}, "multiple of the unit 4"),
        ({"max_devices": 0}, "max_devices 0"),
        ({"dp_sizes": (4, 2)}, "ascending"),
        ({"tp": 0}, "tp and pp"),
        ({"sharded_state_fraction": 1.5}, "sharded"),
        ({"name": ""}, "must not be empty"),
    ],
)
def test_bad_hypernodes_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        trainer(**kw)


def test_state_bytes_per_device_follow_the_layout() -> None:
    node = trainer(migration=MigrationKind.P2P, state_bytes=16 << 30, sharded_state_fraction=0.75)
    # tp × pp = 4: one replica's 16 GiB is 4 GiB per device; 3/4 of it shards over dp.
    assert node.bytes_per_device(4) == 4 << 30
    assert node.bytes_per_device(8) == (1 << 30) + (3 << 30) / 2
    assert node.bytes_per_device(0) == 0.0
    with pytest.raises(ValueError, match="utilization"):
        Node(worker=0, utilization=1.5)


def test_set_workers_replaces_them_all_at_once() -> None:
    graph = Hypergraph.of([HyperNode(name="rollout", kind=ComponentKind.ROLLOUT, tp=2)])
    graph.register_worker("rollout", Node(worker=0, devices=(0, 1)))
    graph.set_workers("rollout", [Node(worker=1, devices=(4, 5)), Node(worker=0, devices=(2, 3))])
    assert [w.devices for w in graph.component("rollout").workers] == [(2, 3), (4, 5)]
    with pytest.raises(ValueError, match="repeated worker"):
        graph.set_workers("rollout", [Node(worker=0), Node(worker=0)])
    with pytest.raises(ValueError, match="unknown component"):
        graph.set_workers("trainer", [])
