"""The controller process: bus, scheduler, coordinator, group managers and the migration drivers.

Runs on rank 0 (or in the user's process under :class:`dynarl.Job`). The coordinator
carries out the scheduler's commands with one driver per migration kind
(:class:`WorkloadMove`, P2P in :mod:`dynarl.runtime.controller`, :class:`RebootMove`).
"""

from __future__ import annotations

from dynarl.runtime.controller._controller import Controller
from dynarl.runtime.controller._coordinator import Coordinator, plan_moves
from dynarl.runtime.controller._dispatch import Dispatcher, SampleAccounting
from dynarl.runtime.controller._durability import AllocationJournal, MoveJournal
from dynarl.runtime.controller._group_manager import GroupManager
from dynarl.runtime.controller._link import WorkerLink, worker_name
from dynarl.runtime.controller._moves import ComponentMove, Driver
from dynarl.runtime.controller._planner_cost import PlannerCost
from dynarl.runtime.controller._progress import Item
from dynarl.runtime.controller._prometheus import MetricsExporter

__all__ = [
    "AllocationJournal",
    "ComponentMove",
    "Controller",
    "Coordinator",
    "Dispatcher",
    "Driver",
    "GroupManager",
    "Item",
    "MetricsExporter",
    "MoveJournal",
    "PlannerCost",
    "SampleAccounting",
    "WorkerLink",
    "plan_moves",
    "worker_name",
]
