"""Small workloads for the simulator tests (seconds of virtual time, milliseconds of wall)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dynarl.sim import AgenticSpec, Workload, load_workload

WORKLOADS = Path(__file__).resolve().parent.parent / "examples" / "workloads"


def shipped(name: str) -> Workload:
    """A shipped workload by file stem."""
    return load_workload(WORKLOADS / f"{name}.toml")


def small(kind: str = "math", *, num_gpus: int = 16, num_prompts: int = 32) -> Workload:
    """A 1.5B-like workload scaled down: few GPUs, a small batch, short outputs."""
    base = shipped("math-1.5b-64gpu")
    agentic = None
    if kind == "agentic":
        agentic = AgenticSpec(
            mean_tool_calls=2.0,
            max_tool_calls=4,
            turn_decay=0.7,
            tool_latency_median_s=1.0,
            tool_latency_sigma=0.5,
            tool_timeout_s=10.0,
            observation_median=100.0,
            observation_sigma=0.5,
        )
    return replace(
        base,
        name=f"small-{kind}",
        kind=kind,  # type: ignore[arg-type]
        agentic=agentic,
        cluster=replace(base.cluster, num_gpus=num_gpus),
        batch=replace(base.batch, num_prompts=num_prompts, group_size=8, max_seq_len=8192),
        lengths=replace(base.lengths, output_median=600.0),
        rollout=replace(base.rollout, kv_capacity_tokens=60_000, max_running_requests=64),
        inference=replace(base.inference, tokens_per_s_per_gpu=4_000.0),
        trainer=replace(base.trainer, tokens_per_s_per_gpu=1_000.0),
        migration=replace(
            base.migration, workload_s=0.5, p2p_s=0.2, phase_switch_s=0.5, weight_sync_s=0.5
        ),
        scheduler=replace(base.scheduler, min_move_interval_s=2.0),
        num_iterations=2,
        num_warmup_iterations=1,
    )
