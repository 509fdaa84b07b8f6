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
from dynarl.migrate.placement import local_shape, trainer_layout
from dynarl.migrate.plan import ReshardPlan, Transfer, plan_reshard
from dynarl.migrate.region import (
    Region,
    Shard,
    TensorSpec,
    box_difference,
    dtype_size,
    flat_range_boxes,
)

__all__ = [
    "BufferParam",
    "CommGroup",
    "DPBuffer",
    "ExecutorConfig",
    "Layout",
    "LayoutGroups",
    "LayoutSpec",
    "ParamSpec",
    "Placement",
    "Region",
    "ReshardPlan",
    "Shard",
    "Sliceable",
    "Stage",
    "TensorSpec",
    "Transfer",
    "TransferReport",
    "box_difference",
    "build_group",
    "checksum",
    "dp_buffer",
    "dp_param_ranges",
    "dtype_size",
    "execute_plan",
    "flat_range_boxes",
    "local_shape",
    "plan_reshard",
    "replicated_layout",
    "state_tensor",
    "trainer_layout",
]
