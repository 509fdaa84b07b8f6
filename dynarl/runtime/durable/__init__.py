"""What survives a crash: the allocation journal, checkpoints, shard files, the sample
manifest and source, and :class:`DurableRun`, which makes a training loop restartable.
"""

from __future__ import annotations

from dynarl.runtime.durable._checkpoint import CheckpointManifest, CheckpointRef, CheckpointStore
from dynarl.runtime.durable._journal import Journal, JournalRead, read_journal, recover
from dynarl.runtime.durable._journal_records import (
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
from dynarl.runtime.durable._manifest import (
    Manifest,
    ManifestConfig,
    ManifestReport,
    StepManifest,
    Violation,
    step_digests,
)
from dynarl.runtime.durable._rng import (
    RngState,
    capture_rng,
    load_rng_file,
    restore_rng,
    save_rng_file,
)
from dynarl.runtime.durable._shard import ShardRecord, TensorEntry
from dynarl.runtime.durable._shardfile import load_shards, save_shards
from dynarl.runtime.durable._source import SampleSource, SourceConfig, Ticket

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
    "load_rng_file",
    "load_shards",
    "read_journal",
    "recover",
    "restore_rng",
    "save_rng_file",
    "save_shards",
    "step_digests",
]
