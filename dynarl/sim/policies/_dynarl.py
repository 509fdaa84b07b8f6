"""dynarl's own scheduler, driven in virtual time (no second copy of any decision).

The policy builds the real :class:`~dynarl.sched.Scheduler` with the simulator's clock,
the pipeline as a :class:`~dynarl.sched.Hypergraph` (rollout → inference → trainer, the
rollout engines registered as its workers with their devices, so placement can release
the least-loaded ones), a :class:`~dynarl.sched.RegressionPredictor` seeded with the
offline profiles, and the modelled migration cost. Every interval it hands the
components' reports to :meth:`Scheduler.handle`; each :class:`MigrationCommand` that
comes back is executed in the model (with its modelled pause), and its
:class:`MoveOutcome` — with one :class:`MigrationRecord` per resized component — goes
back to the scheduler when the pause ends. ``dynarl+priority`` is the same scheduler with
the engines' request queues ordered by DynaRL's priority (completed tool calls, then
reusable cached prefix) instead of FIFO.

Both start from :func:`~dynarl.sim.start_partition` and follow the synchronous
barrier rule (:meth:`Simulation.restore`): when an iteration's training ends, the
pipeline returns to that iteration-start allocation — the trainer shrinks back and its
devices become rollout engines, at the modelled migration cost, overlapping the weight
sync — as RLinf's dynamic scheduling does ("at the end of the step the trainer shrinks
to its initial size"). The move is the pipeline's, not a decision: the scheduler gets no
reports while it runs (a barrier is not an interruptible point) and learns its result
as an external :class:`MoveOutcome`. A scheduler move still in flight at the barrier
finishes first.

A parkable trainer starts each iteration parked (0 devices, its state in host memory) and
so does inference when its minimum is 0; the scheduler unparks them by its own moves (the
modelled cost is the host-link transfer). One more pipeline rule keeps an iteration
finite when the scheduler does not move (safe mode, ``observe_only``) or has not yet:
once rollout is done, a stage that still holds no device while it has work left is
unparked onto idle devices (rollout's, a finished inference's): inference at its minimum
(at least one replica), the trainer onto every idle device, as an external move like the
barrier's. In safe mode a trainer left as the last stage with work also grows onto the
idle devices (a finished rollout parks, so its engines are among them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from dynarl.bus import ComponentReport, MigrationRecord
from dynarl.sched import (
    FifoPolicy,
    HyperEdge,
    Hypergraph,
    MigrationCommand,
    MoveOutcome,
    Node,
    PriorityPolicy,
    RegressionPredictor,
    RequestPolicy,
    Scheduler,
)
from dynarl.sim._components import COMPONENTS, SimEvent, migration_bytes
from dynarl.sim._profile import predictor_profiles, start_partition
from dynarl.sim._simulator import Simulation
from dynarl.types import Allocation

logger = logging.getLogger(__name__)

__all__ = ["DynarlPolicy"]


class DynarlPolicy:
    """The real scheduler in the loop (see the module docstring)."""

    asynchronous = False

    def __init__(self, *, priority: bool = False, partition: Mapping[str, int] | None = None):
        self.priority = priority
        self.name = "dynarl+priority" if priority else "dynarl"
        self.partition = dict(partition) if partition is not None else None
        self.scheduler: Scheduler | None = None
        self.graph = Hypergraph()
        self._number = 0
        self.initial: dict[str, int] = {}
        self._workers = (-1, -1)
        self._barrier: int | None = None  # iteration whose barrier move waits for a move
        self._unpark = False  # rollout is done: check for stages stalled at 0 devices
        self._restoring = False

    def request_policy(self) -> RequestPolicy:
        """The engines' queue order."""
        return PriorityPolicy() if self.priority else FifoPolicy()

    def setup(self, sim: Simulation) -> None:
        """Place the iteration-start allocation; build the graph and the scheduler."""
        w = sim.workload
        self.initial = self.partition if self.partition is not None else start_partition(w)
        sim.assign(self.initial)
        self.graph = Hypergraph.of(
            sim.nodes.values(),
            (
                HyperEdge(src="rollout", dst="inference", channel="samples"),
                HyperEdge(src="inference", dst="trainer", channel="samples"),
            ),
        )
        self._sync_workers(sim)
        self.scheduler = Scheduler(
            graph=self.graph,
            allocation=sim.allocation,
            predictor=RegressionPredictor(predictor_profiles(w)),
            cost=sim.cost,
            clock=sim.clock,
            config=w.scheduler,
            free=sorted(sim.free),
        )

    def _sync_workers(self, sim: Simulation) -> None:
        """Register the rollout engines as workers, in the order their reports list them.

        Engine indices only grow, so (count, highest index) changes whenever the set does.
        """
        engines = sim.rollout.engines
        key = (len(engines), max(engines, default=-1))
        if key != self._workers:
            self._workers = key
            ordered = sorted(engines.values(), key=lambda e: e.index)
            self.graph.set_workers(
                "rollout", (Node(worker=i, devices=e.devices) for i, e in enumerate(ordered))
            )

    def on_reports(self, sim: Simulation, reports: Mapping[str, ComponentReport]) -> None:
        """Feed the instant's reports to the scheduler as one batch (one round sees them
        all); run what it commits."""
        assert self.scheduler is not None
        if self._restoring:
            return
        self._sync_workers(sim)
        for command in self.scheduler.handle_many(reports[name] for name in COMPONENTS):
            self._execute(sim, command)

    def on_event(self, sim: Simulation, event: SimEvent, iteration: int, index: int = 0) -> None:
        """At an iteration's end, return to the iteration-start allocation (the barrier
        rule); once rollout or inference is done, unpark a stalled stage (the module
        docstring)."""
        if event is SimEvent.ITERATION_END:
            self._barrier = iteration
        elif event in (SimEvent.ROLLOUT_DONE, SimEvent.INFERENCE_DONE):
            self._unpark = True
        else:
            return
        self._pipeline_moves(sim)

    def _pipeline_moves(self, sim: Simulation) -> None:
        """Run a pending pipeline move (the barrier first) once no move is in flight."""
        assert self.scheduler is not None
        if self._restoring or self.scheduler.safety.in_flight is not None:
            return
        if self._barrier is not None:
            iteration, self._barrier = self._barrier, None
            self._unpark = False
            self._pipeline_move(sim, self.initial, f"barrier-{iteration}")
        elif self._unpark:
            self._unpark = False
            wanted = _unstalled(sim, frozen=self.scheduler.safety.safe)
            if wanted is not None:
                self._pipeline_move(sim, wanted, f"unpark-{sim.iteration}")

    def _pipeline_move(self, sim: Simulation, sizes: Mapping[str, int], move_id: str) -> None:
        before, start = sim.allocation, sim.loop.now
        self._restoring = True

        def done() -> None:
            self._restoring = False
            assert self.scheduler is not None
            after = sim.allocation
            outcome = MoveOutcome(
                decision_id=move_id,
                ok=True,
                allocation=after,
                records=self._records(sim, move_id, before, after, start),
                external=True,
            )
            for follow in self.scheduler.handle(outcome):
                self._execute(sim, follow)
            self._pipeline_moves(sim)

        sim.restore(sizes, on_done=done)

    def _execute(self, sim: Simulation, command: MigrationCommand) -> None:
        before = sim.allocation
        start = sim.loop.now
        pause = sim.execute(
            command.moves, on_done=lambda: self._finished(sim, command, before, start)
        )
        del pause

    def _finished(
        self, sim: Simulation, command: MigrationCommand, before: Allocation, start: float
    ) -> None:
        assert self.scheduler is not None
        after = sim.allocation
        outcome = MoveOutcome(
            decision_id=command.decision_id,
            ok=True,
            allocation=after,
            records=self._records(sim, command.decision_id, before, after, start),
        )
        for follow in self.scheduler.handle(outcome):
            self._execute(sim, follow)
        self._pipeline_moves(sim)

    def _records(
        self, sim: Simulation, decision_id: str, before: Allocation, after: Allocation, start: float
    ) -> tuple[MigrationRecord, ...]:
        records = []
        for name in COMPONENTS:
            if before.devices(name) == after.devices(name):
                continue
            self._number += 1
            records.append(
                MigrationRecord(
                    migration_id=f"{decision_id}-m{self._number}",
                    decision_id=decision_id,
                    time=sim.loop.now,
                    kind=sim.nodes[name].migration.value,
                    component=name,
                    src_devices=before.devices(name),
                    dst_devices=after.devices(name),
                    outcome="committed",
                    bytes_moved=migration_bytes(
                        sim.workload,
                        name,
                        len(before.devices(name)),
                        len(after.devices(name)),
                    ),
                    pause_s=sim.loop.now - start,
                )
            )
        return tuple(records)


def _unstalled(sim: Simulation, *, frozen: bool = False) -> dict[str, int] | None:
    """Sizes that unpark every stalled stage, or None when none is stalled (or can be yet).

    Once rollout is done, a stage (inference, the trainer) is stalled when it holds no
    device while it has items of the iteration left; while the scheduler is ``frozen`` (in
    safe mode) the trainer is stalled too once inference is done, if idle devices would
    let it grow. The idle devices are the free ones, rollout's (but one engine when
    rollout cannot park), and a finished inference's. A stalled inference gets
    its minimum (at least one replica) from them; a stalled trainer, the last stage, every
    idle device left at its largest valid size (that its old and new state fit in memory
    together, when it grows), as a colocated trainer onloads onto every GPU. Returns None,
    waiting for inference to finish, when the trainer's minimum is not idle yet.
    """
    w = sim.workload
    left = sim.remaining()
    if left["rollout"] > 0:
        return None
    counts = {name: len(sim.holders[name]) for name in COMPONENTS}
    specs = {"inference": w.inference, "trainer": w.trainer}
    stalled = [
        name
        for name, spec in specs.items()
        if counts[name] == 0 and left[name] > 0 and not spec.fused
    ]
    if frozen and counts["trainer"] and left["trainer"] > 0 and left["inference"] == 0:
        stalled.append("trainer")
    if not stalled:
        return None
    parks = sim.nodes["rollout"].zero_allowed
    spare = {
        "rollout": max(counts["rollout"] - (0 if parks else w.rollout.tp), 0),
        "inference": counts["inference"] if left["inference"] == 0 else 0,
    }
    idle = len(sim.free) + sum(spare.values())
    wanted = dict(counts)
    if "inference" in stalled:
        wanted["inference"] = max(w.inference.min_gpus, w.inference.tp)
        idle -= wanted["inference"]
    if "trainer" in stalled:
        fits = _trainer_sizes(sim, counts["trainer"], counts["trainer"] + idle)
        if not fits or idle < 0:
            logger.info("the trainer waits until inference is done (%d idle)", idle)
            return None
        wanted["trainer"] = fits[-1]
        idle -= fits[-1] - counts["trainer"]
    if idle < 0:
        return None
    # Take what the stalled stages get from the donors' idle devices, whole replicas.
    need = sum(wanted[n] - counts[n] for n in stalled) - len(sim.free)
    for donor in ("inference", "rollout"):
        unit = w.inference.tp if donor == "inference" else w.rollout.tp
        take = min(-(-max(need, 0) // unit) * unit, spare[donor] - spare[donor] % unit)
        wanted[donor] -= take
        need -= take
    if need > 0:
        return None
    logger.info("unparking %s at t=%.1f s: %s", stalled, sim.loop.now, wanted)
    return wanted


def _trainer_sizes(sim: Simulation, have: int, most: int) -> list[int]:
    """The trainer's valid sizes above ``have`` up to ``most`` whose state, with the old
    state beside it while it grows, fits a device."""
    node = sim.nodes["trainer"]
    memory = sim.workload.scheduler.device_memory_bytes
    return [
        n
        for n in node.valid_sizes(have + 1, most, 1 << 30)
        if n <= most and node.bytes_per_device(n) + node.bytes_per_device(have) <= memory
    ]
