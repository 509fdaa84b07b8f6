"""The seam to the allocation journal: what the coordinator writes, and when.

:class:`AllocationJournal` is the part of the runtime's journal
(:class:`~dynarl.runtime.durable.Journal`) the coordinator needs; :class:`MoveJournal` maps one
move onto it: the move is one journalled migration (id = the decision's id) towards the
new allocation, named after the component that receives devices (or the one that gives
them up); every step of every component's migration is recorded as it ends; the commit
point is the new allocation committed under that id; a rollback ends it as
``rolled_back`` (or ``failed`` when some part could not be undone). With no journal every
call does nothing. Runs on the controller's event loop (each append fsyncs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from dynarl.runtime.controller._moves import Driver
from dynarl.sched import MigrationCommand
from dynarl.types import Allocation, MigrationKind

__all__ = ["AllocationJournal", "MoveJournal"]


class AllocationJournal(Protocol):
    """An append-only, durable record of committed allocations and migrations."""

    def commit(self, allocation: Allocation, *, migration_id: str = "") -> int:
        """Make ``allocation`` the committed one (ending ``migration_id`` if given);
        returns its epoch once durable."""
        ...

    def begin_migration(
        self,
        *,
        migration_id: str,
        kind: MigrationKind,
        component: str,
        devices: Sequence[int],
        target: Allocation,
        deadline: float,
    ) -> None:
        """Record that migration ``migration_id`` starts towards ``target``."""
        ...

    def record_step(self, migration_id: str, step: str, *, ok: bool, detail: str = "") -> None:
        """Record the outcome of one step of the migration in flight."""
        ...

    def end_migration(
        self, migration_id: str, outcome: Literal["rolled_back", "failed"], reason: str = ""
    ) -> None:
        """Record that the migration in flight ended without committing."""
        ...


class MoveJournal:
    """Writes one move at a time to an :class:`AllocationJournal` (see module docstring)."""

    def __init__(self, journal: AllocationJournal | None) -> None:
        self._journal = journal
        self._recorded: dict[str, int] = {}

    def start(self, allocation: Allocation) -> None:
        """Commit the allocation a job starts (or restarts) with."""
        if self._journal is not None:
            self._journal.commit(allocation)

    def begin(self, command: MigrationCommand, drivers: Sequence[Driver]) -> None:
        """The move of ``command`` starts."""
        if self._journal is None or not drivers:
            return
        main = next((d for d in drivers if d.move.added), drivers[0])
        moved = sorted(
            {d for driver in drivers for d in (*driver.move.added, *driver.move.removed)}
        )
        self._recorded.clear()
        self._journal.begin_migration(
            migration_id=command.decision_id,
            kind=main.move.kind,
            component=main.move.component,
            devices=moved,
            target=command.new_allocation,
            deadline=min(d.deadline for d in drivers),
        )

    def steps(self, command: MigrationCommand, driver: Driver) -> None:
        """Record the steps ``driver`` finished since the last call."""
        if self._journal is None:
            return
        done = driver.state.done
        start = self._recorded.get(driver.migration_id, 0)
        for outcome in done[start:]:
            self._journal.record_step(
                command.decision_id, str(outcome.step), ok=outcome.ok, detail=outcome.detail
            )
        self._recorded[driver.migration_id] = len(done)

    def end(self, command: MigrationCommand, allocation: Allocation | None, reason: str) -> None:
        """The move ended: committed to ``allocation``, or not (``allocation`` None)."""
        if self._journal is None:
            return
        if allocation is not None:
            self._journal.commit(allocation, migration_id=command.decision_id)
        else:
            failed = reason.startswith("rollback failed")
            outcome: Literal["rolled_back", "failed"] = "failed" if failed else "rolled_back"
            self._journal.end_migration(command.decision_id, outcome, reason)
