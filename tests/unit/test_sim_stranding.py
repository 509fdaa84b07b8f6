"""No device idles beside a finished stage: a done rollout parks instead of keeping an engine
that strands the rest of its node, and a trainer left as the last stage with work takes the
idle devices even while the scheduler is in safe mode."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_support import small

from dynarl.sched import OperatorCommand
from dynarl.sim import DynarlPolicy, Simulation, Workload


def strandable() -> Workload:
    """Rollout in 4-GPU engines beside a TP-8 trainer and TP-8 inference, 8 GPUs a node: an
    engine kept on a node leaves its other 4 GPUs to no stage."""
    base = small()
    return replace(
        base,
        num_iterations=2,
        cluster=replace(base.cluster, num_gpus=24),
        rollout=replace(base.rollout, tp=4),
        inference=replace(base.inference, tp=8, min_gpus=0),
        trainer=replace(base.trainer, tp=8, min_gpus=8, parkable=True),
    )


def _trainer_peaks(sim: Simulation) -> list[int]:
    return [sim.timeline.peak("trainer", it.start, it.end) for it in sim.iterations]


@pytest.mark.parametrize("priority", [False, True])
def test_a_finished_rollout_parks_and_the_trainer_gets_every_gpu(priority: bool) -> None:
    workload = strandable()
    policy = DynarlPolicy(priority=priority)
    sim = Simulation(workload, request_policy=policy.request_policy)
    sim.run(policy)
    # Keeping one engine to the barrier capped the trainer at 16 of the 24 GPUs.
    assert _trainer_peaks(sim) == [workload.cluster.num_gpus] * workload.num_iterations
    column = sim.timeline.components.index("rollout")
    assert 0 in {row[column] for row in sim.timeline.counts}


def test_in_safe_mode_the_last_stage_with_work_takes_the_idle_devices() -> None:
    # Safe mode from the start: only the pipeline moves. Once rollout is done inference
    # gets a replica and the trainer the rest; once inference is done, its replica too
    # (before, it idled to the barrier while the trainer worked on).
    workload = strandable()
    policy = DynarlPolicy()
    sim = Simulation(workload, request_policy=policy.request_policy)
    policy.setup = _then_safe_mode(policy)  # type: ignore[method-assign]
    sim.run(policy)
    assert policy.scheduler is not None and policy.scheduler.safety.safe
    assert not [d for d in policy.scheduler.ledger.query(kind="decision") if d.committed]
    assert _trainer_peaks(sim) == [workload.cluster.num_gpus] * workload.num_iterations


def _then_safe_mode(policy: DynarlPolicy):  # type: ignore[no-untyped-def]
    setup = policy.setup

    def wrapped(sim: Simulation) -> None:
        setup(sim)
        assert policy.scheduler is not None
        policy.scheduler.handle(OperatorCommand(action="enter_safe_mode", reason="test"))

    return wrapped
