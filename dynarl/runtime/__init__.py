"""The running system: worker agents, group managers, controller, coordinator, launch.

- :class:`Job`: dynarl embedded in the user's own loop (``async with dynarl.Job(...)``),
  made of :class:`ComponentSpec` s and a :class:`JobConfig`;
- :class:`Controller`: TCPStore, bus server, publisher, one :class:`GroupManager` per
  component, the scheduler coroutine, the :class:`Coordinator` (migrations with leases
  and rollback) and the ledger;
- worker side: :class:`WorkerAgent` (``python -m dynarl.runtime.worker``), roles hosted
  with a :class:`RoleContext`, the role protocols (:class:`Serving`, :class:`Reporting`,
  :class:`Reshardable`, :class:`Checkpointing`);
- :class:`LocalLauncher`, :class:`PlannerCost`, fault injection (:class:`Fault`), the
  Prometheus endpoint (:class:`MetricsExporter`).
"""

from __future__ import annotations

from dynarl.runtime.agent import WorkerAgent
from dynarl.runtime.controller import Controller
from dynarl.runtime.coordinator import Coordinator, plan_moves
from dynarl.runtime.cost import PlannerCost
from dynarl.runtime.dispatch import Dispatcher
from dynarl.runtime.durability import AllocationJournal, MoveJournal
from dynarl.runtime.faults import Fault, FaultAction, FaultInjector, InjectedFault
from dynarl.runtime.job import Job, JobConfig
from dynarl.runtime.launcher import LocalLauncher
from dynarl.runtime.link import WorkerLink
from dynarl.runtime.manager import GroupManager
from dynarl.runtime.moves import ComponentMove
from dynarl.runtime.options import WorkerOptions
from dynarl.runtime.prometheus import MetricsExporter
from dynarl.runtime.role import (
    Checkpointing,
    ComputeThread,
    Reporting,
    Reshardable,
    RoleContext,
    RoleMetrics,
    Serving,
)
from dynarl.runtime.shardfile import load_shards, save_shards
from dynarl.runtime.spec import ComponentSpec, RuntimeConfig
from dynarl.runtime.wire import CallResult

__all__ = [
    "AllocationJournal",
    "CallResult",
    "Checkpointing",
    "ComponentMove",
    "ComponentSpec",
    "ComputeThread",
    "Controller",
    "Coordinator",
    "Dispatcher",
    "Fault",
    "FaultAction",
    "FaultInjector",
    "GroupManager",
    "InjectedFault",
    "Job",
    "JobConfig",
    "LocalLauncher",
    "MetricsExporter",
    "MoveJournal",
    "PlannerCost",
    "Reporting",
    "Reshardable",
    "RoleContext",
    "RoleMetrics",
    "RuntimeConfig",
    "Serving",
    "WorkerAgent",
    "WorkerLink",
    "WorkerOptions",
    "load_shards",
    "plan_moves",
    "save_shards",
]
