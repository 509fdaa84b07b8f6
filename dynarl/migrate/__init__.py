"""State movement: reshard plans, the p2p executor, the three migration kinds.

Pure planning (:mod:`._region`, :mod:`._reshard_plan`, :mod:`._layout`,
:mod:`._trainer_placement`, :mod:`._buffer`, :mod:`._protocol`) imports no
torch.distributed; the torch side (:mod:`._groups`, :mod:`._executor`, :mod:`._p2p`)
carries plans out; :mod:`._megatron_layout` is the only module that knows Megatron-core,
which it imports lazily.

The three migration kinds are state machines with their I/O injected as a host:
:class:`WorkloadMigration` (:class:`WorkloadHost`), :class:`P2PGroupMigration`
(:class:`P2PHost`, every rank; each rank runs a :class:`P2PMigration`) and
:class:`RebootMigration` (:class:`RebootHost`). Each sequences its own steps, growing from
or shrinking to no device included; a runtime drives them through the :class:`Migration`
surface only (``run_to_commit``, then ``commit`` or ``cancel``).
"""

from __future__ import annotations

from dynarl.migrate._buffer import BufferParam, dp_buffer, dp_param_ranges
from dynarl.migrate._drain import PartialRequest, WorkloadHost, WorkloadMigration
from dynarl.migrate._executor import ExecutorConfig, TransferReport, execute_plan
from dynarl.migrate._groups import CommGroup, LayoutGroups, build_group
from dynarl.migrate._layout import (
    Layout,
    LayoutSpec,
    ParamSpec,
    Placement,
    Stage,
    replicated_layout,
    state_tensor,
)
from dynarl.migrate._megatron_layout import (
    install_parallel_state,
    param_names,
    param_specs,
    process_group_collection,
    sharded_state_dict_mismatches,
    state_tensors,
)
from dynarl.migrate._p2p import P2PConfig, P2PMigration, ShardedTrainer
from dynarl.migrate._p2p_group import P2PGroupMigration, P2PHost
from dynarl.migrate._protocol import (
    KIND_STEPS,
    MigrationState,
    Outcome,
    Step,
    new_migration,
    run_step,
)
from dynarl.migrate._reboot_machine import RebootHost, RebootMigration
from dynarl.migrate._region import Region, Shard, TensorSpec
from dynarl.migrate._reshard_plan import ReshardPlan, Transfer, plan_reshard
from dynarl.migrate._step_runner import Migration
from dynarl.migrate._trainer_placement import trainer_layout

__all__ = [
    "KIND_STEPS",
    "BufferParam",
    "CommGroup",
    "ExecutorConfig",
    "Layout",
    "LayoutGroups",
    "LayoutSpec",
    "Migration",
    "MigrationState",
    "Outcome",
    "P2PConfig",
    "P2PGroupMigration",
    "P2PHost",
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
    "Stage",
    "Step",
    "TensorSpec",
    "Transfer",
    "TransferReport",
    "WorkloadHost",
    "WorkloadMigration",
    "build_group",
    "dp_buffer",
    "dp_param_ranges",
    "execute_plan",
    "install_parallel_state",
    "new_migration",
    "param_names",
    "param_specs",
    "plan_reshard",
    "process_group_collection",
    "replicated_layout",
    "run_step",
    "sharded_state_dict_mismatches",
    "state_tensor",
    "state_tensors",
    "trainer_layout",
]
