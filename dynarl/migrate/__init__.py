"""State movement: reshard plans, the p2p executor, the three migration kinds."""

from __future__ import annotations

from dynarl.migrate.buffer import BufferParam, DPBuffer, dp_buffer, dp_param_ranges
from dynarl.migrate.executor import ExecutorConfig, TransferReport, checksum, execute_plan
from dynarl.migrate.groups import CommGroup, LayoutGroups, build_group
from dynarl.migrate.layout import (
    Layout,
    LayoutSpec,
    ParamSpec,
    Placement,
    Sliceable,
    Stage,
    replicated_layout,
    state_tensor,
)
from dynarl.migrate.p2p import P2PConfig, P2PMigration, ShardedTrainer
from dynarl.migrate.placement import local_shape, trainer_layout
from dynarl.migrate.plan import ReshardPlan, Transfer, plan_reshard
from dynarl.migrate.protocol import (
    Migration,
    MigrationState,
    Outcome,
    Start,
    Step,
    begin,
    finish,
    new_migration,
    record_refusal,
    run_step,
)
from dynarl.migrate.reboot import RebootHost, RebootMigration
from dynarl.migrate.region import (
    Region,
    Shard,
    TensorSpec,
    box_difference,
    dtype_size,
    flat_range_boxes,
)
from dynarl.migrate.workload import PartialRequest, WorkloadHost, WorkloadMigration

__all__ = [
    "BufferParam",
    "CommGroup",
    "DPBuffer",
    "ExecutorConfig",
    "Layout",
    "LayoutGroups",
    "LayoutSpec",
    "Migration",
    "MigrationState",
    "Outcome",
    "P2PConfig",
    "P2PMigration",
    "ParamSpec",
    "PartialRequest",
    "Placement",
    "RebootHost",
    "RebootMigration",
    "Region",
    "ReshardPlan",
    "Shard",
    "ShardedTrainer",
    "Sliceable",
    "Stage",
    "Start",
    "Step",
    "TensorSpec",
    "Transfer",
    "TransferReport",
    "WorkloadHost",
    "WorkloadMigration",
    "begin",
    "box_difference",
    "build_group",
    "checksum",
    "dp_buffer",
    "dp_param_ranges",
    "dtype_size",
    "execute_plan",
    "finish",
    "flat_range_boxes",
    "local_shape",
    "new_migration",
    "plan_reshard",
    "record_refusal",
    "replicated_layout",
    "run_step",
    "state_tensor",
    "trainer_layout",
]
