"""Processes, worker groups, launch, the migration coordinator and the journal.

Durability and accounting (used by the controller):

- :class:`Journal` / :func:`recover`: the append-only, fsynced allocation journal (framed
  MessagePack records with CRC-32) and the state a restarted controller recovers from it;
- :class:`CheckpointStore`: checkpoints binding model version, trainer and optimizer
  tensors (in a ``dynarl.migrate`` layout, restorable into another), RNG states and the
  sample cursor; atomic, verified, last K kept;
- :class:`SampleSource`: the deterministic, seekable sample stream;
- :class:`Manifest`: exactly-once accounting of every sample from issue to the trainer.
"""

from __future__ import annotations

from dynarl.runtime.checkpoint import CheckpointManifest, CheckpointRef, CheckpointStore
from dynarl.runtime.journal import Journal, JournalRead, read_journal, recover
from dynarl.runtime.manifest import (
    Manifest,
    ManifestConfig,
    ManifestReport,
    StepManifest,
    Violation,
    step_digests,
)
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
from dynarl.runtime.rng import RngState, capture_rng, restore_rng
from dynarl.runtime.shard import ShardRecord, TensorEntry
from dynarl.runtime.source import SampleSource, SourceConfig, Ticket

__all__ = [
    "AllocationCommitted",
    "CheckpointManifest",
    "CheckpointRef",
    "CheckpointSaved",
    "CheckpointStore",
    "Journal",
    "JournalHeader",
    "JournalRead",
    "JournalRecord",
    "JournalState",
    "Manifest",
    "ManifestConfig",
    "ManifestReport",
    "MigrationBegun",
    "MigrationEnded",
    "MigrationStepped",
    "Restored",
    "RngState",
    "SampleSource",
    "ShardRecord",
    "SourceConfig",
    "StepCompleted",
    "StepManifest",
    "TensorEntry",
    "Ticket",
    "Violation",
    "capture_rng",
    "read_journal",
    "recover",
    "restore_rng",
    "step_digests",
]
