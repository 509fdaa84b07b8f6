"""The scheduler: one coroutine that turns reports into decisions and migration commands.

Time comes only from the injected :class:`Clock`, inputs only from the event stream
(component reports, move outcomes, quota changes, operator commands, ticks) and outputs
only go to the injected :class:`CommandSink`, so the simulator drives the very same code
in virtual time. :meth:`Scheduler.handle_many` is the synchronous step (it never waits; a batch of
events, then at most one round on the state after all of them); :meth:`Scheduler.run`
feeds it from an async iterator of events or batches. Every decision round, committed
or not, goes to the ledger with what the scheduler saw of each component at that round;
so do safe-mode transitions and, once the work it knew of is done, the realised effect of
every committed move, which also feeds the loss rule that holds a component whose moves
lost time (see :mod:`dynarl.sched._effects`). Runs on the controller, in its event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from dynarl.bus import (
    Commit,
    ComponentReport,
    DecisionReason,
    MinimumInterval,
    NoDonor,
    ObserveOnly,
    QuotaRefused,
    Reclaim,
)
from dynarl.sched._decision import Decision, MigrationCost, RoundInput
from dynarl.sched._effects import LossRule, MoveEffects, Realised, observe
from dynarl.sched._events import (
    Clock,
    CommandSink,
    MigrationCommand,
    MoveOutcome,
    OperatorCommand,
    QuotaChange,
    SchedulerEvent,
)
from dynarl.sched._graph import Hypergraph, HyperNode
from dynarl.sched._ledger import Ledger
from dynarl.sched._ledger_records import SafeModeRecord
from dynarl.sched._planner import Safety, decide, finished_donors, hold, starved, unblock
from dynarl.sched._predictor import ThroughputPredictor
from dynarl.sched._quota import plan_quota_change
from dynarl.sched._sched_config import SchedulerConfig
from dynarl.sched._window import ComponentStats, DonorSignal, WindowSet, detect_donors
from dynarl.types import Allocation

__all__ = ["Scheduler"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Counters:
    rounds: int = 0
    transitions: int = 0
    last_round: float = -float("inf")
    history: list[Decision] = field(default_factory=list)


class Scheduler:
    """Decides reallocations from component reports (see the module docstring).

    Its decisions are numbered from ``first_decision`` (``d000001`` ...). Raises
    ValueError for an allocation that names components the graph lacks.
    """

    def __init__(
        self,
        *,
        graph: Hypergraph | Mapping[str, HyperNode],
        allocation: Allocation,
        predictor: ThroughputPredictor,
        cost: MigrationCost,
        clock: Clock,
        config: SchedulerConfig | None = None,
        ledger: Ledger | None = None,
        free: Sequence[int] = (),
        submit_timeout_s: float = 30.0,
        first_decision: int = 1,
    ) -> None:
        self._graph = graph
        self.config = config or SchedulerConfig()
        unknown = set(allocation.components) - set(self.nodes)
        if unknown:
            raise ValueError(f"allocation names components not in the graph: {sorted(unknown)}")
        self.allocation = allocation
        self._quota = set(free) | {d for _, devs in allocation.assignment for d in devs}
        self.predictor = predictor
        self.cost = cost
        self.clock = clock
        self.ledger = ledger if ledger is not None else Ledger()
        self.windows = WindowSet(self.config)
        self.safety = Safety()
        self.effects = MoveEffects()
        self.losses = LossRule(self.config)
        self.observe_only = self.config.observe_only
        self.submit_timeout_s = submit_timeout_s
        self._counters = _Counters(rounds=first_decision - 1)

    # ------------------------------------------------------------------ state
    @property
    def nodes(self) -> dict[str, HyperNode]:
        """The components, as the graph describes them now."""
        if isinstance(self._graph, Hypergraph):
            return {node.name: node for node in self._graph.components}
        return dict(self._graph)

    @property
    def allocation(self) -> Allocation:
        """The allocation in force (the last one a move committed, or the initial one)."""
        return self._allocation

    @allocation.setter
    def allocation(self, allocation: Allocation) -> None:
        self._allocation = allocation
        self._free: tuple[int, ...] | None = None

    @property
    def free(self) -> tuple[int, ...]:
        """Devices of the job's quota no component holds."""
        if self._free is None:
            held = {d for _, devs in self._allocation.assignment for d in devs}
            self._free = tuple(sorted(self._quota - held))
        return self._free

    @property
    def last_decision(self) -> Decision | None:
        """The latest round's decision."""
        return self._counters.history[-1] if self._counters.history else None

    # ------------------------------------------------------------------- loop
    async def run(
        self,
        events: AsyncIterable[SchedulerEvent | Sequence[SchedulerEvent]],
        commands: CommandSink,
    ) -> None:
        """Handle ``events`` until the stream ends, submitting every command.

        An item of the stream is one event or a batch of them (every event queued when the
        loop got to the queue, see :func:`~dynarl.sched.queued_batches`), handled
        by :meth:`handle_many`. A submission that fails or exceeds ``submit_timeout_s``
        counts as a failed move.
        """
        async for item in events:
            batch = item if isinstance(item, Sequence) else (item,)
            for command in self.handle_many(batch):
                try:
                    async with asyncio.timeout(self.submit_timeout_s):
                        await commands.submit(command)
                except (TimeoutError, OSError) as err:
                    logger.warning("submitting %s failed: %r", command.decision_id, err)
                    self._outcome(
                        MoveOutcome(
                            decision_id=command.decision_id,
                            ok=False,
                            allocation=self.allocation,
                            reason=f"submission failed: {err!r}",
                        )
                    )

    def handle(self, event: SchedulerEvent) -> list[MigrationCommand]:
        """Take one event; returns the commands to carry out (never waits)."""
        return self.handle_many((event,))

    def handle_many(self, events: Iterable[SchedulerEvent]) -> list[MigrationCommand]:
        """Take every event in order, then run at most one round, on the state after all
        of them, if the decision interval has elapsed; returns the commands (never waits).

        So a round never weighs one component's fresh report against another's one
        interval old when both arrived together. A quota change acts at once (its own
        round or forced shrink) and an operator command only sets the mode: a round is
        due only after a report, a move outcome or a tick.
        """
        commands: list[MigrationCommand] = []
        due = False
        for event in events:
            match event:
                case ComponentReport():
                    self._observe(event)
                case MoveOutcome():
                    self._outcome(event)
                case QuotaChange():
                    commands += self._quota_change(event)
                case OperatorCommand():
                    self._operator(event)
            due |= not isinstance(event, QuotaChange | OperatorCommand)
        now = self.clock.now()
        if not due or now - self._counters.last_round < self.config.decision_interval_s:
            return commands
        return commands + self.round(now)

    def _observe(self, report: ComponentReport) -> None:
        if report.component not in self.nodes:
            logger.warning("report for unknown component %r dropped", report.component)
            return
        try:
            self.windows.observe(report)
        except ValueError as err:
            logger.warning("report dropped: %s", err)
            return
        if self.safety.in_flight is None:
            self.predictor.observe(
                report.component, self.allocation.count(report.component), report
            )
        for realised in self.effects.observe(report):
            self._learn(realised)

    def _learn(self, realised: Realised) -> None:
        """Write a move's measured effect to the ledger and hand it to the loss rule."""
        delta, error = realised.realised_iteration_delta_s, realised.prediction_error
        if delta is None and error is None:
            return
        self.ledger.fill_realised(
            realised.decision_id, realised_iteration_delta_s=delta, prediction_error=error
        )
        self.losses.record(realised, self._errors())

    def _errors(self) -> dict[str, tuple[float, int]]:
        return {name: self.predictor.prediction_error(name) for name in self.nodes}

    def _outcome(self, outcome: MoveOutcome) -> None:
        for record in outcome.records:
            self.ledger.append(record)
        # The runtime's word on what is in force is authoritative, whichever move it ends.
        self.allocation = outcome.allocation
        if outcome.external:
            self.safety = self.safety.moved_externally(self.clock.now())
            logger.info(
                "external move %s: allocation now %s",
                outcome.decision_id,
                outcome.allocation.counts(),
            )
            return
        if outcome.decision_id != self.safety.in_flight:
            logger.warning("outcome of %s, which is not the move in flight", outcome.decision_id)
            return
        if not outcome.ok:
            self.effects.failed(outcome.decision_id)
        self._set_safety(self.safety.finished(outcome.ok, self.clock.now(), self.config))
        logger.info(
            "move %s %s", outcome.decision_id, "done" if outcome.ok else f"failed: {outcome.reason}"
        )

    def _operator(self, command: OperatorCommand) -> None:
        logger.info("operator: %s (%s)", command.action, command.reason)
        if command.action == "enter_safe_mode":
            entered = self.safety.enter(command.reason, self.clock.now(), operator=True)
            self._set_safety(entered, operator=True)
        elif command.action == "leave_safe_mode":
            self._set_safety(self.safety.leave(), f"operator: {command.reason}", operator=True)
        else:
            self.observe_only = command.action == "observe_only"

    # ------------------------------------------------------------------ round
    def round(self, now: float) -> list[MigrationCommand]:
        """Run one decision round at ``now`` and record it; returns its commands."""
        self._counters.last_round = now
        self.predictor.refit()
        stats = self.windows.stats()
        cooldown = f"cool-down of {self.config.safe_mode_cooldown_s} s over"
        self._set_safety(self.safety.tick(now, self.config), cooldown)
        errors = self._errors()
        self._set_safety(self.safety.check_errors(errors, now, self.config))
        self.losses.release(errors)
        donors: Sequence[DonorSignal] = detect_donors(stats, self.config)
        gate = self.safety.gate(now, self.config)
        if isinstance(gate, MinimumInterval):
            idle = finished_donors(donors, stats, self.nodes, self.safety.last_move_end)
            if idle:
                gate, donors = None, idle
        inputs = self._inputs(now, stats, donors)
        if gate is not None or (not donors and not self.free):
            decision = hold(gate or NoDonor(), inputs)
            if self.safety.liveness_exempt(gate) and starved(stats, inputs.counts()):
                decision = unblock(inputs, decision)
        else:
            decision = decide(inputs)
        return self._record(decision, now)

    def _set_safety(self, safety: Safety, left: str = "", *, operator: bool = False) -> None:
        """Adopt ``safety``; a start or end of safe mode is logged and recorded (``left``:
        why it ended)."""
        before, self.safety = self.safety, safety
        if before.safe_since == safety.safe_since:
            return
        reason = safety.safe_reason if safety.safe else left
        logger.warning("safe mode %s: %s", "on" if safety.safe else "off", reason)
        self._counters.transitions += 1
        self.ledger.append(
            SafeModeRecord(
                record_id=f"s{self._counters.transitions:06d}",
                time=self.clock.now(),
                safe=safety.safe,
                reason=reason,
                operator=operator,
            )
        )

    def _next_id(self) -> str:
        self._counters.rounds += 1
        return f"d{self._counters.rounds:06d}"

    def _record(self, decision: Decision, now: float) -> list[MigrationCommand]:
        decision_id = self._next_id()
        self._counters.history.append(decision)
        del self._counters.history[:-64]
        record = decision.to_record(decision_id)
        stats = self.windows.stats()
        self.ledger.append(
            observe(decision_id, decision, stats, decision.old_allocation, len(self.free))
        )
        commands = []
        if decision.committed and self.observe_only:
            assert isinstance(decision.reason, Commit), "a committed round's reason is a Commit"
            record = msgspec.structs.replace(
                record,
                committed=False,
                new_allocation=record.old_allocation,
                reason=ObserveOnly(would=decision.reason),
            )
        elif decision.committed:
            commands.append(
                MigrationCommand(
                    decision_id=decision_id,
                    time=now,
                    old_allocation=decision.old_allocation,
                    new_allocation=decision.new_allocation(),
                    moves=decision.moves,
                )
            )
            self.safety = self.safety.started(decision_id)
            self.effects.committed(decision_id, decision, stats, self.nodes)
            logger.info("%s: %s", decision_id, decision.reason)
        self.ledger.append(record)
        return commands

    # ------------------------------------------------------------------ quota
    def _quota_change(self, change: QuotaChange) -> list[MigrationCommand]:
        """Grants join the free pool and trigger a round; reclaims force a shrink.

        A reclaim is the cluster's order, so its command is emitted even in safe mode and
        observe-only mode; a change outside the job's elastic bounds is refused (see
        :func:`~dynarl.sched._quota.plan_quota_change`).
        """
        now = self.clock.now()
        plan = plan_quota_change(
            change,
            quota=self._quota,
            allocation=self.allocation,
            nodes=self.nodes,
            config=self.config,
        )
        if plan.refused:
            logger.error("%s", plan.refused)
            return self._record(self._hold(QuotaRefused(detail=plan.refused), now), now)
        self._quota = (self._quota | plan.granted) - plan.reclaimed
        self._free = None
        logger.info(
            "quota: +%d -%d devices, now %d",
            len(plan.granted),
            len(plan.reclaimed),
            plan.num_devices,
        )
        if plan.new_allocation is None:
            return self.round(now)
        decision_id = self._next_id()
        record = self._hold(Reclaim(num_devices=len(plan.reclaimed)), now)
        self.ledger.append(
            msgspec.structs.replace(
                record.to_record(decision_id),
                committed=True,
                new_allocation=plan.new_allocation.counts(),
            )
        )
        self.safety = self.safety.started(decision_id)
        return [
            MigrationCommand(
                decision_id=decision_id,
                time=now,
                old_allocation=self.allocation,
                new_allocation=plan.new_allocation,
                moves=plan.moves,
                forced=True,
            )
        ]

    def _hold(self, reason: DecisionReason, now: float) -> Decision:
        return hold(reason, self._inputs(now, self.windows.stats()))

    def _inputs(
        self, now: float, stats: Mapping[str, ComponentStats], donors: Sequence[DonorSignal] = ()
    ) -> RoundInput:
        """What a round at ``now`` reads: the state after every event handled so far."""
        return RoundInput(
            nodes=self.nodes,
            allocation=self.allocation,
            free=self.free,
            stats=stats,
            donors=tuple(donors),
            predictor=self.predictor,
            cost=self.cost,
            config=self.config,
            time=now,
            held=frozenset(self.losses.held),
        )
