"""State movement: reshard plans, the p2p executor, the three migration kinds."""

from __future__ import annotations

from dynarl.migrate.plan import ReshardPlan, Transfer, plan_reshard
from dynarl.migrate.region import (
    DTYPE_SIZES,
    Region,
    Shard,
    TensorSpec,
    box_difference,
    dtype_size,
    flat_range_boxes,
)

__all__ = [
    "DTYPE_SIZES",
    "Region",
    "ReshardPlan",
    "Shard",
    "TensorSpec",
    "Transfer",
    "box_difference",
    "dtype_size",
    "flat_range_boxes",
    "plan_reshard",
]
