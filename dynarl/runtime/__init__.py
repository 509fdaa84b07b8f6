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

Durability and accounting (used by the controller):

- :class:`Journal` / :func:`recover`: the append-only, fsynced allocation journal (framed
  MessagePack records with CRC-32) and the state a restarted controller recovers from it;
- :class:`CheckpointStore`: checkpoints binding model version, trainer and optimizer
  tensors (in a ``dynarl.migrate`` layout, restorable into another), RNG states and the
  sample cursor; atomic, verified, last K kept;
- :class:`SampleSource`: the deterministic, seekable sample stream;
- :class:`Manifest`: exactly-once accounting of every sample from issue to the trainer;
- :class:`DurableRun`: all of them around a durable :class:`Job`'s loop (checkpoint,
  resume, recover from a dead worker).
"""

from __future__ import annotations

from dynarl.runtime.agent import WorkerAgent
from dynarl.runtime.checkpoint import CheckpointManifest, CheckpointRef, CheckpointStore
from dynarl.runtime.controller import Controller
from dynarl.runtime.coordinator import Coordinator, plan_moves
from dynarl.runtime.cost import PlannerCost
from dynarl.runtime.dispatch import Dispatcher, SampleAccounting
from dynarl.runtime.durability import AllocationJournal, MoveJournal
from dynarl.runtime.durable import DurableConfig, DurableRun, Recovery
from dynarl.runtime.faults import Fault, FaultAction, FaultInjector, InjectedFault
from dynarl.runtime.job import Job, JobConfig
from dynarl.runtime.journal import Journal, JournalRead, read_journal, recover
from dynarl.runtime.launcher import LocalLauncher
from dynarl.runtime.link import WorkerLink
from dynarl.runtime.manager import GroupManager
from dynarl.runtime.manifest import (
    Manifest,
    ManifestConfig,
    ManifestReport,
    StepManifest,
    Violation,
    step_digests,
)
from dynarl.runtime.moves import ComponentMove
from dynarl.runtime.options import WorkerOptions
from dynarl.runtime.prometheus import MetricsExporter
from dynarl.runtime.records import (
    AllocationCommitted,
    CheckpointSaved,
    JournalHeader,
    JournalRecord,
    JournalState,
    MigrationBegun,
    MigrationEnded,
    MigrationStepped,
    Restored,
    StepCompleted,
)
from dynarl.runtime.rng import RngState, capture_rng, load_rng_file, restore_rng, save_rng_file
from dynarl.runtime.role import (
    Checkpointing,
    ComputeThread,
    Reporting,
    Reshardable,
    RoleContext,
    RoleMetrics,
    Serving,
)
from dynarl.runtime.shard import ShardRecord, TensorEntry
from dynarl.runtime.shardfile import load_shards, save_shards
from dynarl.runtime.source import SampleSource, SourceConfig, Ticket
from dynarl.runtime.spec import ComponentSpec, RuntimeConfig
from dynarl.runtime.wire import CallResult

__all__ = [
    "AllocationCommitted",
    "AllocationJournal",
    "CallResult",
    "CheckpointManifest",
    "CheckpointRef",
    "CheckpointSaved",
    "CheckpointStore",
    "Checkpointing",
    "ComponentMove",
    "ComponentSpec",
    "ComputeThread",
    "Controller",
    "Coordinator",
    "Dispatcher",
    "DurableConfig",
    "DurableRun",
    "Fault",
    "FaultAction",
    "FaultInjector",
    "GroupManager",
    "InjectedFault",
    "Job",
    "JobConfig",
    "Journal",
    "JournalHeader",
    "JournalRead",
    "JournalRecord",
    "JournalState",
    "LocalLauncher",
    "Manifest",
    "ManifestConfig",
    "ManifestReport",
    "MetricsExporter",
    "MigrationBegun",
    "MigrationEnded",
    "MigrationStepped",
    "MoveJournal",
    "PlannerCost",
    "Recovery",
    "Reporting",
    "Reshardable",
    "Restored",
    "RngState",
    "RoleContext",
    "RoleMetrics",
    "RuntimeConfig",
    "SampleAccounting",
    "SampleSource",
    "Serving",
    "ShardRecord",
    "SourceConfig",
    "StepCompleted",
    "StepManifest",
    "TensorEntry",
    "Ticket",
    "Violation",
    "WorkerAgent",
    "WorkerLink",
    "WorkerOptions",
    "capture_rng",
    "load_rng_file",
    "load_shards",
    "plan_moves",
    "read_journal",
    "recover",
    "restore_rng",
    "save_rng_file",
    "save_shards",
    "step_digests",
]
