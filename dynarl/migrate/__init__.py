"""State movement: reshard plans, the p2p executor, the three migration kinds.

Pure planning (:mod:`.region`, :mod:`.plan`, :mod:`.layout`, :mod:`.placement`,
:mod:`.buffer`, :mod:`.protocol`) imports no torch.distributed; the torch side
(:mod:`.groups`, :mod:`.executor`, :mod:`.p2p`) carries plans out; :mod:`.megatron_layout`
is the only module that knows Megatron-core, which it imports lazily.
"""

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
from dynarl.migrate.megatron_layout import (
    install_parallel_state,
    merge_stage_specs,
    param_names,
    param_specs,
    process_group_collection,
    restore_parallel_state,
    sharded_state_dict_mismatches,
    state_tensors,
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
    "install_parallel_state",
    "local_shape",
    "merge_stage_specs",
    "new_migration",
    "param_names",
    "param_specs",
    "plan_reshard",
    "process_group_collection",
    "record_refusal",
    "replicated_layout",
    "restore_parallel_state",
    "run_step",
    "sharded_state_dict_mismatches",
    "state_tensor",
    "state_tensors",
    "trainer_layout",
]
