"""A discrete-event simulator that drives the real scheduler in virtual time.

Load a workload (:func:`load_workload`), compare policies on its trace (:func:`compare`,
:func:`run_policy`, :func:`sweep`), render the results (:func:`format_table`,
:func:`results_json`, :func:`plot_timelines`). The simulator uses ``dynarl.sched``'s
scheduler, predictor, request queues and hybrid controller as they are; migrations,
engines and stages are modelled.
"""

from __future__ import annotations

from dynarl.sim.components import (
    EngineView,
    ModelledMigrationCost,
    RolloutModel,
    SimPolicy,
    build_nodes,
    migration_bytes,
)
from dynarl.sim.engine import Engine, SimRequest
from dynarl.sim.events import EventLoop, Handle, Task, Wait
from dynarl.sim.plot import plot_timeline, plot_timelines
from dynarl.sim.policies import (
    DynarlPolicy,
    RlinfRule,
    StaticSequential,
    StaticSplit,
    VerlHybrid,
    make_policy,
)
from dynarl.sim.profile import (
    TimeCurve,
    best_partition,
    fit_time_curve,
    predictor_profiles,
    rlinf_dp_sizes,
    rollout_alone,
    rollout_time,
    stage_times,
    start_partition,
)
from dynarl.sim.report import (
    GpuAccounts,
    IterationStats,
    RunResult,
    Timeline,
    format_table,
    results_json,
    speedups,
    summarise,
)
from dynarl.sim.rollout import Rollout, engine_groups
from dynarl.sim.runs import compare, run_policy, sweep
from dynarl.sim.simulator import Simulation
from dynarl.sim.specs import (
    AgenticSpec,
    BatchSpec,
    ClusterSpec,
    LengthSpec,
    MigrationSpec,
    ModelSpec,
    RolloutSpec,
    StageSpec,
    VerlSpec,
)
from dynarl.sim.stage import Chunk, Stage
from dynarl.sim.trace import IterationTrace, build_trace
from dynarl.sim.vector import VectorRollout
from dynarl.sim.workload import (
    Workload,
    dump_workload,
    file_hash,
    load_workload,
    with_overrides,
    workload_from_dict,
)

__all__ = [
    "AgenticSpec",
    "BatchSpec",
    "Chunk",
    "ClusterSpec",
    "DynarlPolicy",
    "Engine",
    "EngineView",
    "EventLoop",
    "GpuAccounts",
    "Handle",
    "IterationStats",
    "IterationTrace",
    "LengthSpec",
    "MigrationSpec",
    "ModelSpec",
    "ModelledMigrationCost",
    "RlinfRule",
    "Rollout",
    "RolloutModel",
    "RolloutSpec",
    "RunResult",
    "SimPolicy",
    "SimRequest",
    "Simulation",
    "Stage",
    "StageSpec",
    "StaticSequential",
    "StaticSplit",
    "Task",
    "TimeCurve",
    "Timeline",
    "VectorRollout",
    "VerlHybrid",
    "VerlSpec",
    "Wait",
    "Workload",
    "best_partition",
    "build_nodes",
    "build_trace",
    "compare",
    "dump_workload",
    "engine_groups",
    "file_hash",
    "fit_time_curve",
    "format_table",
    "load_workload",
    "make_policy",
    "migration_bytes",
    "plot_timeline",
    "plot_timelines",
    "predictor_profiles",
    "results_json",
    "rlinf_dp_sizes",
    "rollout_alone",
    "rollout_time",
    "run_policy",
    "speedups",
    "stage_times",
    "start_partition",
    "summarise",
    "sweep",
    "with_overrides",
    "workload_from_dict",
]
