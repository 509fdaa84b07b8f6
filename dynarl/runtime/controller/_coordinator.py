"""The coordinator: carries the scheduler's ``MigrationCommand`` s out as migrations.

:func:`plan_moves` (pure) turns a command into one :class:`~dynarl.runtime.controller._moves.
ComponentMove` per component whose devices change, with its migration kind: workload for
serving components, P2P or reboot (the component's choice) for the others, reboot in
place (sleep or wake where the roles are) for a non-serving component that shrinks to
nothing or grows back from nothing. Components that give devices up go first.

:class:`Coordinator` executes one command at a time, holding the locks of every
component it touches (a trainer's step in progress finishes first): every migration runs
its steps up to commit; then, if every lease still has ``commit_margin_s`` left, all
commit, else (or on any failure) all roll back in reverse order and the previous
allocation stays. Once the new allocation is journalled (the commit point) it is the one
in force, even if a participant then fails to commit (the outcome says so).
Each migration has an id (``<decision>-<component>``), a lease and
idempotent phases; a command already executed is answered from its recorded outcome.
Every migration's :class:`~dynarl.bus.MigrationRecord` is published and travels in the
:class:`~dynarl.sched.MoveOutcome` back to the scheduler, which writes it to the ledger.

One clock: the coordinator, its drivers, their leases, step timeouts and pauses read (and
wait on) the injected :class:`~dynarl.sched.Clock` only, never ``time`` directly, so a move
runs the same in virtual time. ``asyncio.timeout`` deadlines that bound real I/O (a request
to a worker, a dispatcher's drain) stay on the event loop's clock. Runs on the
controller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from dynarl.bus import MigrationRecord
from dynarl.runtime._faults import FaultInjector
from dynarl.runtime._spec import ComponentSpec, RuntimeConfig
from dynarl.runtime.controller._durability import AllocationJournal, MoveJournal
from dynarl.runtime.controller._group_manager import GroupManager
from dynarl.runtime.controller._moves import ComponentMove, Driver, P2PMove
from dynarl.runtime.controller._planner_cost import PlannerCost
from dynarl.runtime.controller._reboot_move import RebootMove
from dynarl.runtime.controller._workload_move import WorkloadMove
from dynarl.sched import Clock, MigrationCommand, MoveOutcome
from dynarl.types import Allocation, MigrationKind

__all__ = ["Coordinator", "plan_moves"]

logger = logging.getLogger(__name__)

_OUTCOMES_KEPT = 256
"""Outcomes of executed commands kept to answer a repeated command."""


def plan_moves(
    command: MigrationCommand,
    specs: Mapping[str, ComponentSpec],
    sleeping: Mapping[str, tuple[int, ...]],
) -> tuple[ComponentMove, ...]:
    """The per-component migrations of ``command``, donors first (pure).

    ``sleeping`` maps a component that holds no device to where its roles sleep with
    their state. Raises ValueError for an unknown component, or for a stateful component
    growing back from nothing onto devices other than those where its state sleeps.
    """
    old, new = command.old_allocation, command.new_allocation
    moves = []
    for name in sorted(set(old.components) | set(new.components)):
        src, dst = old.devices(name), new.devices(name)
        if src == dst:
            continue
        if name not in specs:
            raise ValueError(f"the command moves unknown component {name!r}")
        kind, in_place = specs[name].migration_kind, False
        if kind is not MigrationKind.WORKLOAD and not (src and dst):
            kind, in_place = MigrationKind.REBOOT, True
            asleep = sleeping.get(name, ())
            if not src and asleep and set(asleep) != set(dst):
                raise ValueError(
                    f"{name} sleeps with its state on {list(asleep)}: it can only wake there, "
                    f"not on {list(dst)}"
                )
        moves.append(ComponentMove(component=name, kind=kind, src=src, dst=dst, in_place=in_place))
    moves.sort(key=lambda m: (bool(m.added), bool(m.removed) and bool(m.added), m.component))
    return tuple(moves)


class Coordinator:
    """Executes migration commands (see the module docstring); the scheduler's sink."""

    def __init__(
        self,
        *,
        managers: Mapping[str, GroupManager],
        specs: Mapping[str, ComponentSpec],
        allocation: Allocation,
        config: RuntimeConfig,
        faults: FaultInjector,
        clock: Clock,
        cost: PlannerCost,
        outcomes: Callable[[MoveOutcome], None],
        publish: Callable[[MigrationRecord], None],
        journal: AllocationJournal | None = None,
        epoch: int = 0,
    ) -> None:
        self._managers, self._specs, self._config = managers, specs, config
        self.faults, self._clock, self.cost = faults, clock, cost
        self._outcomes, self._publish = outcomes, publish
        self.journal = MoveJournal(journal)
        self.allocation = allocation
        """The allocation in force."""
        self.epoch = epoch
        """The latest layout epoch handed out."""
        self._sleeping: dict[str, tuple[int, ...]] = {}
        self._done: dict[str, MoveOutcome] = {}
        self._queue: asyncio.Queue[MigrationCommand] = asyncio.Queue()
        self._lock = asyncio.Lock()

    async def submit(self, command: MigrationCommand) -> None:
        """Queue ``command`` (the scheduler's ``CommandSink``); its outcome comes back later."""
        await self._queue.put(command)

    async def run(self) -> None:
        """Execute queued commands one by one, forever (cancel to stop)."""
        while True:
            command = await self._queue.get()
            self._outcomes(await self.execute(command))

    async def execute(
        self, command: MigrationCommand, *, lease_s: float | None = None
    ) -> MoveOutcome:
        """Carry ``command`` out, each migration under a lease of ``lease_s`` seconds
        (default ``RuntimeConfig.lease_s``); returns how it ended (never raises for a
        failed move)."""
        async with self._lock:
            if command.decision_id in self._done:
                return self._done[command.decision_id]
            if command.old_allocation != self.allocation:
                return self._end(command, False, "stale: the allocation changed meanwhile", [])
            try:
                moves = plan_moves(command, self._specs, self._sleeping)
            except ValueError as exc:
                return self._end(command, False, str(exc), [])
            if not moves:  # the allocation in force: nothing migrates, nothing is journalled
                return self._end(command, True, "", [])
            lease = lease_s if lease_s is not None else self._config.lease_s
            drivers = [self._driver(command.decision_id, move, lease) for move in moves]
            names = sorted({move.component for move in moves})
            async with contextlib.AsyncExitStack() as stack:
                for name in names:
                    await stack.enter_async_context(self._managers[name].lock)
                self.journal.begin(command, drivers)
                return await self._carry_out(command, drivers)

    def _driver(self, decision_id: str, move: ComponentMove, lease_s: float) -> Driver:
        kinds: dict[MigrationKind, type[Driver]] = {
            MigrationKind.WORKLOAD: WorkloadMove,
            MigrationKind.P2P: P2PMove,
            MigrationKind.REBOOT: RebootMove,
        }
        return kinds[move.kind](
            move,
            self._managers[move.component],
            migration_id=f"{decision_id}-{move.component}",
            lease_s=lease_s,
            faults=self.faults,
            epochs=self.next_epoch,
            clock=self._clock,
        )

    def next_epoch(self) -> int:
        """A layout epoch never handed out before (names the groups of a new layout)."""
        self.epoch += 1
        return self.epoch

    async def _carry_out(self, command: MigrationCommand, drivers: list[Driver]) -> MoveOutcome:
        started: list[Driver] = []
        failure = ""
        for driver in drivers:
            started.append(driver)
            try:
                outcome = await driver.pre_commit()
            except Exception as exc:  # a step outside a state machine: the move fails
                logger.warning("%s: %r", driver.migration_id, exc)
                failure = f"{driver.migration_id}: {type(exc).__name__}: {exc}"
                break
            finally:
                self.journal.steps(command, driver)
            if outcome is not None:
                failure = f"{driver.migration_id}: {outcome.step} failed: {outcome.detail}"
                break
        now = self._clock.now()
        if not failure and any(d.deadline - now < self._config.commit_margin_s for d in drivers):
            failure = "lease lapsed before commit"
        if failure:
            return await self._roll_back(command, started, failure)
        self.journal.end(command, command.new_allocation, "")  # the commit point, durable
        results = []
        for driver in drivers:
            try:
                outcome = await driver.commit()
            except Exception as exc:  # a participant failed past the commit point
                logger.warning("%s: commit: %r", driver.migration_id, exc)
                results.append((driver, "failed", f"commit: {type(exc).__name__}: {exc}"))
                continue
            results.append((driver, "committed" if outcome.ok else "failed", outcome.detail))
        ok = all(result == "committed" for _, result, _ in results)
        if not ok:
            # Past the commit point the journal holds the new allocation: it stays in
            # force, and what a failed participant lost is recovered there.
            logger.error("%s: journalled as committed, but a commit failed", command.decision_id)
        return self._end(command, ok, "" if ok else "commit failed", results, committed=True)

    async def _roll_back(
        self, command: MigrationCommand, started: list[Driver], failure: str
    ) -> MoveOutcome:
        logger.warning("%s rolls back: %s", command.decision_id, failure)
        results = []
        for driver in reversed(started):
            try:
                outcome = await driver.cancel(failure)
            except Exception as exc:  # the rollback's boundary: reported as failed
                logger.exception("%s: rollback failed", driver.migration_id)
                results.append((driver, "failed", f"rollback: {exc!r}"))
                continue
            finally:
                self.journal.steps(command, driver)
            state = "rolled_back" if outcome.ok else "failed"
            results.append((driver, state, failure if outcome.ok else outcome.detail))
        undone = all(state == "rolled_back" for _, state, _ in results)
        self.journal.end(command, None, failure if undone else f"rollback failed: {failure}")
        return self._end(command, False, failure, results)

    def _end(
        self,
        command: MigrationCommand,
        ok: bool,
        reason: str,
        results: list[tuple[Driver, str, str]],
        *,
        committed: bool = False,
    ) -> MoveOutcome:
        records = tuple(self._record(command, *result) for result in results)
        allocation = self._allocation_after(command, ok or committed, results)
        self.allocation = allocation
        outcome = MoveOutcome(
            decision_id=command.decision_id,
            ok=ok,
            allocation=self.allocation,
            reason=reason,
            records=records,
        )
        self._done[command.decision_id] = outcome
        while len(self._done) > _OUTCOMES_KEPT:  # older commands are stale anyway
            del self._done[next(iter(self._done))]
        logger.info("%s: %s", command.decision_id, "committed" if ok else f"failed: {reason}")
        return outcome

    def _allocation_after(
        self, command: MigrationCommand, ok: bool, results: list[tuple[Driver, str, str]]
    ) -> Allocation:
        if ok:
            return command.new_allocation
        committed = {
            d.move.component: d.move.dst for d, state, _ in results if state == "committed"
        }
        if not committed:
            return self.allocation
        mapping = {name: committed.get(name, devs) for name, devs in self.allocation.assignment}
        try:
            return Allocation.of(mapping)
        except ValueError:
            logger.error("%s: partial commit left devices shared", command.decision_id)
            return self.allocation

    def _record(
        self, command: MigrationCommand, driver: Driver, state: str, reason: str
    ) -> MigrationRecord:
        move = driver.move
        if state == "committed" and move.in_place:
            self._sleeping[move.component] = move.src if not move.dst else ()
        if state == "committed":
            self.cost.observe(move.kind, nbytes=driver.bytes_moved, seconds=driver.pause_s)
        record = MigrationRecord(
            migration_id=driver.migration_id,
            decision_id=command.decision_id,
            time=self._clock.now(),
            kind=str(move.kind),
            component=move.component,
            src_devices=move.src,
            dst_devices=move.dst,
            outcome=state,
            reason=reason,
            bytes_moved=driver.bytes_moved,
            pause_s=driver.pause_s,
        )
        self._publish(record)
        return record
