"""DataRouter: affinity, least-loaded placement, worker removal, per-worker priority order."""

from __future__ import annotations

import pytest

from dynarl.sched import Affinity, DataRouter, FifoPolicy, RoutedItem


def item(i: int, episode: str, affinity: Affinity = Affinity.NONE, status: int = 0) -> RoutedItem:
    return RoutedItem(
        item_id=f"i{i}", episode=episode, affinity=affinity, status=status, cached_prefix=100
    )


def test_none_affinity_spreads_to_the_least_loaded_lowest_first() -> None:
    router = DataRouter([2, 0, 1])
    routing = router.distribute_data([item(i, f"e{i}") for i in range(7)])
    assert routing.assignment == ((0, ("i0", "i3", "i6")), (1, ("i1", "i4")), (2, ("i2", "i5")))
    assert routing.unroutable == ()
    assert [router.load(w) for w in router.workers] == [3, 2, 2]


def test_must_and_prefer_follow_the_episode() -> None:
    router = DataRouter([0, 1], prefer_slack=1)
    router.distribute_data([item(0, "a"), item(1, "b")])  # a -> 0, b -> 1
    routing = router.distribute_data(
        [item(2, "b", Affinity.MUST, status=1), item(3, "b", Affinity.PREFER, status=1)]
    )
    # Both follow episode b to worker 1; the second is still within the slack.
    assert routing.assignment == ((1, ("i2", "i3")),)
    assert router.status("b") == (1, 1)
    # Now worker 1 holds 3 and worker 0 holds 1: prefer gives up beyond the slack.
    assert router.distribute_data([item(4, "b", Affinity.PREFER)]).assignment == ((0, ("i4",)),)
    lost = router.distribute_data([item(5, "zzz", Affinity.MUST)])
    assert lost.assignment == () and "no previous worker" in lost.unroutable[0][1]


def test_removing_a_worker_hands_back_its_queue_and_drops_its_affinities() -> None:
    router = DataRouter([0, 1])
    router.distribute_data([item(i, f"e{i}") for i in range(4)])
    left = router.remove_worker(1)
    assert [r.request_id for r in left] == ["i1", "i3"]
    assert router.workers == (0,)
    assert router.status("e1") == (None, 0)
    again = router.distribute_data(
        [RoutedItem(item_id=r.request_id, episode="e1", affinity=Affinity.PREFER) for r in left]
    )
    assert again.assignment == ((0, ("i1", "i3")),)
    with pytest.raises(ValueError, match="worker 1 is not routed to"):
        router.priority_schedule(1, 1)


def test_priority_schedule_orders_by_tool_calls_then_prefix_and_tracks_in_flight() -> None:
    router = DataRouter([0])
    router.distribute_data(
        [
            RoutedItem(item_id="new", episode="x", status=0),
            RoutedItem(item_id="late", episode="y", status=3),
            RoutedItem(item_id="mid", episode="z", status=1),
        ]
    )
    router.distribute_data(
        [
            RoutedItem(
                item_id="late2", episode="y", status=3, affinity=Affinity.MUST, cached_prefix=500
            )
        ]
    )
    batch = router.priority_schedule(0, 2)
    assert [r.request_id for r in batch] == ["late2", "late"]  # same turn count, cached prefix wins
    assert router.load(0) == 4
    router.done(0, "late2")
    router.evict(0, {"mid": 0})
    assert [r.request_id for r in router.priority_schedule(0, 5)] == ["mid", "new"]
    assert router.load(0) == 3


def test_fifo_policy_and_rebalance() -> None:
    router = DataRouter([0, 1], policy=FifoPolicy())
    router.distribute_data([item(0, "a", status=5), item(1, "b"), item(2, "c", status=9)])
    assert [r.request_id for r in router.priority_schedule(0, 2)] == ["i0", "i2"]
    router.clear_sticky()
    assert router.status("a") == (None, 5)
    with pytest.raises(ValueError, match="already routed"):
        router.add_worker(0)


def test_only_the_most_recent_episodes_keep_their_affinity() -> None:
    router = DataRouter([0, 1], max_episodes=2)
    router.distribute_data([item(0, "a", status=1), item(1, "b", status=2)])
    router.distribute_data([item(2, "a", Affinity.MUST, status=3), item(3, "c")])
    # a was routed again after b, so b is the one forgotten when c arrives.
    assert router.status("a") == (0, 3)
    assert router.status("b") == (None, 0)
    assert router.status("c") == (1, 0)
    lost = router.distribute_data([item(4, "b", Affinity.MUST)])
    assert lost.assignment == () and "no previous worker" in lost.unroutable[0][1]
    with pytest.raises(ValueError, match="max_episodes"):
        DataRouter([0], max_episodes=0)


def test_a_joining_worker_takes_the_backlog_that_would_run_last_down_to_the_slack() -> None:
    router = DataRouter([0], prefer_slack=2)
    items = {"i99": item(99, "e9")}  # episode e9 starts on worker 0 ...
    items |= {f"i{i}": item(i, f"e{i}", Affinity.PREFER, status=i % 3) for i in range(9)}
    items["i9"] = item(9, "e9", Affinity.MUST)  # ... and i9 must stay there
    router.distribute_data(list(items.values()))
    router.add_worker(1)
    moved = router.share_with(1, items.__getitem__)
    # DynaRL's key runs most tool calls first: the last to run are those with none, the
    # latest arrival first (i9 must stay), then those with one.
    assert moved == ["i6", "i3", "i0", "i99", "i7"]
    assert [router.load(w) for w in router.workers] == [6, 5]  # 6 <= 5 + 2: within the slack
    assert [r.request_id for r in router.queued(1)] == ["i99", "i0", "i3", "i6", "i7"]
    assert all(r.cached_prefix == 0 for r in router.queued(1))
    assert [router.status(f"e{i}")[0] for i in (9, 0, 3, 6, 7, 1)] == [1, 1, 1, 1, 1, 0]
    router.add_worker(2)
    router.remove_worker(2)
    assert router.share_with(1, items.__getitem__) == []  # within the slack already
