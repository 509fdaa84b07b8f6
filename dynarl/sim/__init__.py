"""A discrete-event simulator that drives the real scheduler in virtual time.

Load a workload (:func:`load_workload`), compare policies on its trace (:func:`compare`,
:func:`run_policy`, :func:`sweep`), calibrate its engine model on a real engine
(:class:`EngineProfile`, :func:`spec_digest`) and predict a replay
(:func:`replay_rollout`), render the results (:func:`format_table`,
:func:`results_json`, :func:`plot_timelines`; a sweep's: :func:`format_sweep`,
:func:`plot_sweep`). The simulator uses ``dynarl.sched``'s scheduler, predictor, request
queues and hybrid controller as they are; migrations, engines and stages are modelled.
"""

from __future__ import annotations

from dynarl.sim._calibration import (
    DecodePoint,
    EngineProfile,
    PrefillPoint,
    RolloutReplay,
    replay_rollout,
    spec_digest,
)
from dynarl.sim._components import SimEvent
from dynarl.sim._event_loop import EventLoop
from dynarl.sim._plot import plot_sweep, plot_timelines
from dynarl.sim._profile import rollout_alone, start_partition
from dynarl.sim._results import format_sweep, format_table, results_json
from dynarl.sim._rollout import Rollout
from dynarl.sim._runs import compare, run_policy, sweep
from dynarl.sim._simulator import Simulation
from dynarl.sim._specs import (
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
from dynarl.sim._trace import IterationTrace, agentic_trace, build_trace
from dynarl.sim._workload_file import (
    Workload,
    dump_workload,
    load_workload,
    with_overrides,
    workload_from_dict,
)
from dynarl.sim.policies import DynarlPolicy

__all__ = [
    "AgenticSpec",
    "BatchSpec",
    "ClusterSpec",
    "DecodePoint",
    "DynarlPolicy",
    "EngineProfile",
    "EventLoop",
    "IterationTrace",
    "LengthSpec",
    "MigrationSpec",
    "ModelSpec",
    "PrefillPoint",
    "Rollout",
    "RolloutReplay",
    "RolloutSpec",
    "SimEvent",
    "Simulation",
    "StageSpec",
    "VerlSpec",
    "Workload",
    "agentic_trace",
    "build_trace",
    "compare",
    "dump_workload",
    "format_sweep",
    "format_table",
    "load_workload",
    "plot_sweep",
    "plot_timelines",
    "replay_rollout",
    "results_json",
    "rollout_alone",
    "run_policy",
    "spec_digest",
    "start_partition",
    "sweep",
    "with_overrides",
    "workload_from_dict",
]
