"""A fused inference stage (a trainer that scores its own log-probs): no time, no GPU."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from sim_support import small

from dynarl.sched import FifoPolicy
from dynarl.sim import DynarlPolicy, Simulation, StageSpec
from dynarl.sim._workload_file import Workload
from dynarl.sim.policies._static import StaticSequential


def _fused(workload: Workload) -> Workload:
    inference = StageSpec(tp=1, tokens_per_s_per_gpu=math.inf, min_gpus=0)
    trainer = replace(workload.trainer, min_gpus=0)
    return replace(workload, inference=inference, trainer=trainer, num_iterations=2)


def test_a_fused_stage_takes_no_time_on_no_gpu() -> None:
    spec = StageSpec(tp=1, tokens_per_s_per_gpu=math.inf)
    assert spec.fused and spec.rate(0) == math.inf
    assert not StageSpec(tp=1, tokens_per_s_per_gpu=10.0).fused
    with pytest.raises(ValueError, match="fused"):
        StageSpec(tp=1, tokens_per_s_per_gpu=math.inf, min_gpus=1)


def test_sequential_and_dynarl_run_without_an_inference_gpu() -> None:
    workload = _fused(small("math", num_gpus=8, num_prompts=16))
    n = workload.cluster.num_gpus
    sequential = Simulation(workload, request_policy=FifoPolicy)
    seq = sequential.run(StaticSequential())
    dynamic = Simulation(workload, request_policy=FifoPolicy)
    dyn = dynamic.run(DynarlPolicy(partition={"rollout": n, "inference": 0, "trainer": 0}))
    for sim, result in ((sequential, seq), (dynamic, dyn)):
        assert len(sim.iterations) == workload.num_iterations
        assert 0 < result.iteration_s < math.inf
    # The inference stage never held a GPU; both trainers got devices from rollout.
    for sim in (sequential, dynamic):
        column = sim.timeline.components.index
        assert all(row[column("inference")] == 0 for row in sim.timeline.counts)
        assert max(row[column("trainer")] for row in sim.timeline.counts) >= 1
