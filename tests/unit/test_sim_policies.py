"""Every policy on a small workload: conservation, and each baseline decides as documented."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import pytest
from sim_support import shipped, small

from dynarl.bus import ComponentReport, DecisionRecord, MigrationRecord
from dynarl.sched import DeviceMove, FifoPolicy, MigrationCommand, PriorityPolicy, Resize
from dynarl.sim import DynarlPolicy, SimEvent, Simulation, start_partition
from dynarl.sim._components import ModelledMigrationCost, SimPolicy, migration_bytes
from dynarl.sim._profile import rlinf_dp_sizes
from dynarl.sim.policies import POLICY_NAMES
from dynarl.sim.policies._registry import make_policy
from dynarl.sim.policies._rlinf import RlinfRule
from dynarl.sim.policies._static import StaticSequential, StaticSplit
from dynarl.sim.policies._verl import VerlHybrid
from dynarl.types import MigrationKind


class Recorder:
    """Wraps a policy: records its events and every device move the simulation executes."""

    def __init__(self, inner: SimPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.asynchronous = inner.asynchronous
        self.events: list[tuple[float, SimEvent, int]] = []
        self.moves: list[tuple[float, tuple[DeviceMove, ...]]] = []

    def setup(self, sim: Simulation) -> None:
        original = sim.execute

        def execute(moves, **kwargs):  # type: ignore[no-untyped-def]
            self.moves.append((sim.loop.now, tuple(moves)))
            return original(moves, **kwargs)

        sim.execute = execute  # type: ignore[method-assign]
        self.inner.setup(sim)

    def on_reports(self, sim: Simulation, reports: Mapping[str, ComponentReport]) -> None:
        self.inner.on_reports(sim, reports)

    def on_event(self, sim: Simulation, event: SimEvent, iteration: int, index: int = 0) -> None:
        self.events.append((sim.loop.now, event, index))
        self.inner.on_event(sim, event, iteration, index)


def _run(policy: SimPolicy, kind: str = "math", iterations: int = 2) -> tuple[Simulation, Recorder]:
    workload = replace(small(kind), num_iterations=iterations)
    request = policy.request_policy if isinstance(policy, DynarlPolicy) else FifoPolicy
    sim = Simulation(workload, request_policy=request)
    recorder = Recorder(policy)
    sim.run(recorder)
    return sim, recorder


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("kind", ["math", "agentic"])
def test_every_policy_trains_every_iteration_and_conserves_devices(name: str, kind: str) -> None:
    sim, _ = _run(make_policy(name), kind)
    workload = sim.workload
    assert [it.index for it in sim.iterations] == list(range(workload.num_iterations))
    assert all(it.samples == workload.batch.num_samples for it in sim.iterations)
    assert all(sum(row) == workload.cluster.num_gpus for row in sim.timeline.counts)
    # The timeline ends when the run does (the plot's last step stops there), not later.
    assert sim.timeline.end is not None and sim.timeline.end >= sim.timeline.times[-1]
    if not make_policy(name).asynchronous:
        assert sim.timeline.end == pytest.approx(sim.iterations[-1].end)
    held = [d for devs in sim.holders.values() for d in devs] + [*sim.free, *sim.transit]
    assert sorted(held) == list(range(workload.cluster.num_gpus))
    result = sim.result(name)
    assert result.throughput > 0 and 0 <= result.idle_share <= 1


def test_static_sequential_gives_every_gpu_to_one_stage_at_a_time() -> None:
    sim, recorder = _run(StaticSequential())
    for row in sim.timeline.counts:
        assert sum(1 for count in row[:3] if count) <= 1
    events = [e for _, e, _ in recorder.events]
    assert all(isinstance(e, SimEvent) for e in events)
    assert events[0] is SimEvent.ITERATION_START
    assert events.index(SimEvent.ROLLOUT_DONE) < events.index(SimEvent.INFERENCE_DONE)
    # Each event is still its name, for the callers that compare strings.
    assert SimEvent.ROLLOUT_DONE == "rollout_done" and f"{SimEvent.MINIBATCH}" == "minibatch"
    assert all(len(moves) == 1 for _, moves in recorder.moves)


def test_static_split_never_moves() -> None:
    sim, recorder = _run(StaticSplit())
    assert not recorder.moves
    assert len(set(sim.timeline.counts)) == 1


def test_rlinf_rule_acts_only_at_minibatch_boundaries_and_restores_at_step_end() -> None:
    policy = RlinfRule()
    sim, recorder = _run(policy)
    workload = sim.workload
    boundaries = {t for t, e, _ in recorder.events if e is SimEvent.MINIBATCH}
    ends = {t for t, e, _ in recorder.events if e is SimEvent.ITERATION_END}
    grows = [m for m in recorder.moves if any(mv.dst == "trainer" for mv in m[1])]
    assert grows, "the trainer grew at some boundary"
    for t, moves in recorder.moves:
        assert t in boundaries or t in ends or t > min(ends)  # restore may wait for a move
        if t in boundaries:
            assert all(mv.dst == "trainer" for mv in moves), "nothing returns within a step"
    valid = set(rlinf_dp_sizes(workload))
    for row in sim.timeline.counts:
        assert row[2] == 0 or (row[2] // workload.trainer.tp) in valid
    start = sim.timeline.count_at("trainer", sim.iterations[-1].start + 1e-9)
    assert start == policy.initial["trainer"]


def test_rlinf_rule_releases_lowest_index_engines_first() -> None:
    policy = RlinfRule()
    sim = Simulation(small())
    released: list[list[int]] = []
    original = sim.rollout.remove_devices

    def remove(devices):  # type: ignore[no-untyped-def]
        engines = sorted(sim.rollout.engines.values(), key=lambda e: e.index)
        gone = set(devices)
        released.append([e.index for e in engines if gone & set(e.devices)])
        released[-1].append(-1)
        released[-1] += [e.index for e in engines if not gone & set(e.devices)]
        return original(devices)

    sim.rollout.remove_devices = remove  # type: ignore[method-assign]
    sim.run(policy)
    for order in released:
        cut = order.index(-1)
        gone, kept = order[:cut], order[cut + 1 :]
        if gone and kept:
            assert max(gone) < min(kept)


def test_verl_hybrid_runs_the_real_controller_unclamped() -> None:
    policy = VerlHybrid()
    _, recorder = _run(policy, iterations=5)
    controller = policy.controller
    assert controller is not None
    assert controller.policy.clamp_ratio is False  # type: ignore[attr-defined]
    assert controller.activate_count >= 1 and controller.deactivate_count >= 1
    assert recorder.moves, "hybrid replicas moved between trainer and rollout"


def test_dynarl_executes_exactly_what_the_scheduler_commits() -> None:
    policy = DynarlPolicy()
    sim, recorder = _run(policy)
    scheduler = policy.scheduler
    assert scheduler is not None
    committed = scheduler.ledger.query(kind="decision", committed=True)
    assert committed and all(isinstance(r, DecisionRecord) for r in committed)
    migrations = scheduler.ledger.query(kind="migration")
    barriers = {m.decision_id for m in migrations if m.decision_id.startswith("barrier-")}  # type: ignore[union-attr]
    # Every move is a committed decision, or the pipeline's return to the start at one of
    # the barriers (the last may still be moving when the run ends).
    iterations = sim.workload.num_iterations
    assert len(recorder.moves) == len(committed) + iterations
    assert {f"barrier-{i}" for i in range(iterations - 1)} <= barriers
    assert migrations and all(isinstance(m, MigrationRecord) for m in migrations)
    assert all(m.outcome == "committed" and m.pause_s > 0 for m in migrations)  # type: ignore[union-attr]
    assert scheduler.allocation == sim.allocation
    assert scheduler.safety.in_flight is None


def test_migration_bytes_per_kind() -> None:
    w = small()
    weights = 2.0 * w.model.num_params
    # Workload migration: added engines load their weight shards; releases send nothing.
    assert migration_bytes(w, "rollout", 4, 6) == int(weights * 2 / w.rollout.tp)
    assert migration_bytes(w, "rollout", 6, 4) == 0
    assert migration_bytes(w, "inference", 2, 4) == int(weights * 2 / w.inference.tp)
    # P2P: the added ranks' replicated state, plus the re-partitioned sharded state.
    state, f, tp = w.model.state_bytes, w.model.sharded_state_fraction, w.trainer.tp
    grow = migration_bytes(w, "trainer", 2, 8)
    assert grow == int(state * (1 - f) * 6 / tp + state * f * (1 - 2 / 8))
    assert migration_bytes(w, "trainer", 8, 2) == int(state * f * (1 - 2 / 8))
    assert migration_bytes(w, "trainer", 4, 4) == 0
    # Park and unpark: all the state the GPUs hold goes to or comes from the host.
    assert migration_bytes(w, "trainer", 0, 8) == int(state * (1 - f) * 8 / tp + state * f)
    assert migration_bytes(w, "trainer", 8, 0) == migration_bytes(w, "trainer", 0, 8)
    with pytest.raises(ValueError, match="nope"):
        migration_bytes(w, "nope", 1, 2)


def test_parking_and_unparking_cost_the_state_over_the_host_links() -> None:
    w = shipped("math-7b-64gpu")
    cost = ModelledMigrationCost(
        spec=w.migration, sharded_state_fraction=w.model.sharded_state_fraction
    )
    state, tp = w.model.state_bytes, w.trainer.tp

    def trainer(old: int, new: int) -> Resize:
        return Resize(
            component="trainer",
            migration=MigrationKind.P2P,
            old_devices=old,
            new_devices=new,
            tp=tp,
            state_bytes=state,
        )

    # 7B on its 4-GPU minimum (TP 4, DP 1): 30.5 GB a GPU over 50 GB/s, ~0.61 s.
    assert w.trainer.parkable and w.trainer.min_gpus == 4
    assert cost.estimate((trainer(0, 4),)).seconds == pytest.approx(state / 4 / 50e9)
    assert cost.estimate((trainer(4, 0),)).seconds == pytest.approx(0.6096, abs=1e-3)
    # At DP 8 each GPU holds its replicated quarter and an eighth of the sharded part.
    per_gpu = state / tp * (0.25 + 0.75 / 8)
    assert cost.estimate((trainer(32, 0),)).seconds == pytest.approx(per_gpu / 50e9)
    # A reshard between non-zero sizes keeps its P2P figure; a move costs its slowest part.
    assert cost.estimate((trainer(4, 8),)).seconds == w.migration.p2p_s
    rollout = Resize(
        component="rollout", migration=MigrationKind.WORKLOAD, old_devices=8, new_devices=4
    )
    assert cost.estimate((trainer(0, 4), rollout)).seconds == w.migration.workload_s


def test_a_parked_trainer_is_unparked_by_the_scheduler_at_the_host_link_cost() -> None:
    policy = DynarlPolicy()
    sim, _ = _run(policy)
    assert sim.workload.trainer.parkable
    column = sim.timeline.components.index("trainer")
    assert sim.timeline.counts[0][column] == 0
    assert policy.scheduler is not None
    unparks = [
        m
        for m in policy.scheduler.ledger.query(kind="migration")
        if isinstance(m, MigrationRecord)
        and m.component == "trainer"
        and not m.src_devices
        and not m.decision_id.startswith(("barrier", "unpark"))
    ]
    assert unparks, "the scheduler never unparked the trainer"
    for m in unparks:
        unpark = Resize(
            component="trainer",
            migration=MigrationKind.P2P,
            old_devices=0,
            new_devices=len(m.dst_devices),
            tp=sim.nodes["trainer"].tp,
            state_bytes=sim.nodes["trainer"].state_bytes,
        )
        # The move lasts its slowest part: at least the state's trip over the host links.
        assert m.pause_s >= sim.cost.park_seconds(unpark) > 0


def test_dynarl_ledger_records_the_bytes_each_migration_moves() -> None:
    policy = DynarlPolicy()
    sim, _ = _run(policy)
    assert policy.scheduler is not None
    migrations = policy.scheduler.ledger.query(kind="migration")
    assert migrations
    for m in migrations:
        assert isinstance(m, MigrationRecord)
        old, new = len(m.src_devices), len(m.dst_devices)
        assert m.bytes_moved == migration_bytes(sim.workload, m.component, old, new)
    assert any(m.bytes_moved > 0 for m in migrations)  # type: ignore[union-attr]


def test_dynarl_returns_to_the_iteration_start_allocation_at_every_barrier() -> None:
    policy = DynarlPolicy()
    sim, recorder = _run(policy, iterations=3)
    start = start_partition(sim.workload)
    assert sim.timeline.counts[0][:3] == (start["rollout"], start["inference"], start["trainer"])
    ends = [t for t, e, _ in recorder.events if e is SimEvent.ITERATION_END]
    for end in ends[:-1]:
        # The barrier move runs at once and is the only move until it has arrived.
        (moves,) = [m for t, m in recorder.moves if t == end]
        assert {mv.src for mv in moves} >= {"trainer"}
        arrived = min(t for t in sim.timeline.times if t > end)
        assert sim.timeline.count_at("trainer", arrived) == start["trainer"]
        assert sim.timeline.count_at("rollout", arrived) == start["rollout"]
        assert not [t for t, _ in recorder.moves if end < t < arrived]


def test_dynarl_registers_the_rollout_engines_and_releases_the_least_loaded() -> None:
    policy = DynarlPolicy()
    sim = Simulation(replace(small(), num_iterations=2), request_policy=policy.request_policy)
    spread: list[float] = []
    seen: set[str] = set()
    original = sim.rollout.remove_devices

    def remove(devices):  # type: ignore[no-untyped-def]
        gone = set(devices)
        engines = sorted(sim.rollout.engines.values(), key=lambda e: e.index)
        decision = policy.scheduler.safety.in_flight if policy.scheduler else None
        if decision is not None and decision not in seen:
            # A decision's first move: the scheduler saw the engines as its workers.
            seen.add(decision)
            workers = policy.graph.component("rollout").workers
            assert [w.devices for w in workers] == [e.devices for e in engines]
            out = [e.utilization() for e in engines if gone & set(e.devices)]
            kept = [e.utilization() for e in engines if not gone & set(e.devices)]
            if out and kept:
                spread.append(sum(out) / len(out) - sum(kept) / len(kept))
        return original(devices)

    sim.rollout.remove_devices = remove  # type: ignore[method-assign]
    sim.run(policy)
    # Every decision released engines less busy, on average, than the ones it kept (it
    # reads the report of the same instant; receivers take node-local pairs, so a pair's
    # total decides, not each engine's).
    assert spread and max(spread) < 0


def test_dynarl_priority_orders_the_engines_by_priority() -> None:
    assert isinstance(DynarlPolicy(priority=True).request_policy(), PriorityPolicy)
    assert isinstance(DynarlPolicy().request_policy(), FifoPolicy)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("round-robin")


def test_moves_charge_the_modelled_pause() -> None:
    sim, recorder = _run(DynarlPolicy())
    spec = sim.workload.migration
    first_time, moves = recorder.moves[0]
    pauses = [
        sim.cost.seconds(sim.nodes[name].migration)
        for name in {mv.src for mv in moves} | {mv.dst for mv in moves}
        if name is not None
    ]
    arrived = min(t for t in sim.timeline.times if t > first_time)
    assert arrived == pytest.approx(first_time + max(pauses))
    assert max(pauses) in (spec.workload_s, spec.p2p_s)
    assert math.isfinite(arrived)


@pytest.mark.parametrize("parkable", [False, True])
@pytest.mark.parametrize("kind", ["math", "agentic"])
def test_dynarl_completes_every_iteration_when_its_scheduler_never_moves(
    kind: str, parkable: bool
) -> None:
    # Safe mode and observe_only freeze the allocation. Without parking every stage starts
    # with at least one replica (inference's minimum is 0 in the shipped files; starting
    # it there deadlocked). A parkable trainer and a zero-minimum inference start parked,
    # and the pipeline rule gives each its minimum once rollout is done.
    base = replace(small(kind), num_iterations=2)
    workload = replace(
        base,
        scheduler=replace(base.scheduler, observe_only=True),
        trainer=replace(base.trainer, parkable=parkable),
    )
    start = start_partition(workload)
    assert workload.inference.min_gpus == 0
    if parkable:
        assert start["inference"] == start["trainer"] == 0
        assert start["rollout"] == workload.cluster.num_gpus
    else:
        assert start["inference"] >= workload.inference.tp
        assert start["trainer"] >= workload.trainer.tp
    policy = DynarlPolicy()
    sim = Simulation(workload, request_policy=policy.request_policy)
    result = sim.run(policy)
    assert [it.index for it in result.iterations] == [0, 1]
    assert all(it.samples == workload.batch.num_samples for it in result.iterations)
    assert sim.timeline.counts[0][:3] == (start["rollout"], start["inference"], start["trainer"])
    column = sim.timeline.components.index("trainer")
    held = {row[column] for row in sim.timeline.counts}
    if not parkable:
        assert held == {start["trainer"]}
        return
    # Both stalled once rollout is done: inference gets a replica, the trainer every
    # other device (the finished rollout parks), at a whole number of its replicas.
    idle = workload.cluster.num_gpus - workload.inference.tp
    unparked = idle - idle % workload.trainer.tp
    assert unparked >= max(workload.trainer.min_gpus, workload.trainer.tp)
    assert held == {0, unparked}


class RoundSpy(Recorder):
    """Records, for each round run while an instant's reports are handed over, the time of
    the latest report the scheduler holds of each component, and the instant's time."""

    def __init__(self, inner: DynarlPolicy) -> None:
        super().__init__(inner)
        self.instant: float | None = None
        self.seen: list[tuple[float, dict[str, float]]] = []

    def setup(self, sim: Simulation) -> None:
        super().setup(sim)
        assert isinstance(self.inner, DynarlPolicy)
        scheduler = self.inner.scheduler
        assert scheduler is not None
        original = scheduler.round

        def spied(now: float) -> list[MigrationCommand]:
            if self.instant is not None:
                latest = {n: s.latest.time for n, s in scheduler.windows.stats().items()}
                self.seen.append((self.instant, latest))
            return original(now)

        scheduler.round = spied  # type: ignore[method-assign]

    def on_reports(self, sim: Simulation, reports: Mapping[str, ComponentReport]) -> None:
        self.instant = reports["rollout"].time
        try:
            super().on_reports(sim, reports)
        finally:
            self.instant = None


def test_dynarl_rounds_on_every_report_of_an_instant() -> None:
    spy = RoundSpy(DynarlPolicy())
    workload = replace(small("agentic"), num_iterations=2)
    Simulation(workload, request_policy=FifoPolicy).run(spy)
    assert spy.seen
    for instant, latest in spy.seen:
        assert latest == dict.fromkeys(("rollout", "inference", "trainer"), instant)
