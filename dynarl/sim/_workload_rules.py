"""The rules a workload must hold across its tables, so that the simulator models a job
that could run (``docs/workloads.md``, "Rules").

Each table checks its own ranges when it is built (``_specs.py``); :func:`check_workload`
checks what ties tables together and raises ``ValueError`` naming every key involved as
the file spells it (``[trainer] min_gpus = 6``) and its value:

- ``kind`` is ``math`` or ``agentic``, and only an agentic workload has ``[agentic]``;
- the seed is not negative (numpy's generators refuse it);
- at least one measured iteration, and reports at a positive interval;
- every TP size fits a node and divides it (TP groups never span nodes);
- one rollout engine and each stage's smallest replica fit the cluster side by side
  (``static-split`` and ``rlinf-rule`` run them so, the dynamic policies start so);
- only inference may be fused, only the trainer may park;
- the trace's prompt clip (``max_seq_len // 4``) is at least the prompt median, so at
  most half the prompts are cut; one engine's KV holds one sequence of ``max_seq_len``;
- a rollout engine's weights and KV, an inference replica's weights and the trainer's
  state at its smallest size fit the GPUs that hold them;
- the scheduler plans on the simulated nodes and GPU memory.

Pure: reads a workload, raises or returns nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynarl.sim._specs import StageSpec
    from dynarl.sim._workload_file import Workload

__all__ = ["GIB", "check_workload", "smallest_replica", "trainer_bytes_per_gpu"]

GIB = 1 << 30
"""Bytes in a GiB (``[cluster] gpu_memory_gib``)."""


def check_workload(workload: Workload) -> None:
    """Raise ValueError for the first rule ``workload`` breaks (see the module docstring)."""
    for check in (
        _kind,
        _seed,
        _iterations,
        _tp_sizes,
        _roles,
        _minimums,
        _lengths,
        _memory,
        _scheduler,
    ):
        check(workload)


def smallest_replica(stage: StageSpec) -> int:
    """The fewest GPUs ``stage`` runs on (0 when fused)."""
    return 0 if stage.fused else max(stage.min_gpus, stage.tp)


def trainer_bytes_per_gpu(workload: Workload, num_gpus: int) -> float:
    """Trainer state one GPU holds on ``num_gpus`` GPUs: its TP shard of the replicated
    part plus its DP share of the part the distributed optimizer shards."""
    tp = workload.trainer.tp
    dp = max(num_gpus // tp, 1)
    f = workload.model.sharded_state_fraction
    return workload.model.state_bytes / tp * ((1.0 - f) + f / dp)


def _kind(w: Workload) -> None:
    if w.kind not in ("math", "agentic"):
        raise ValueError(f"kind = {w.kind!r} must be 'math' or 'agentic'")
    if w.kind == "agentic" and w.agentic is None:
        raise ValueError("kind = 'agentic' needs an [agentic] table")
    if w.kind == "math" and w.agentic is not None:
        raise ValueError("kind = 'math' takes no [agentic] table (multi-turn settings)")


def _seed(w: Workload) -> None:
    if w.seed < 0:
        raise ValueError(f"seed = {w.seed} must be >= 0 (numpy seeds the trace with it)")


def _iterations(w: Workload) -> None:
    if w.num_warmup_iterations < 0:
        raise ValueError(f"num_warmup_iterations = {w.num_warmup_iterations} must be >= 0")
    if w.num_warmup_iterations >= w.num_iterations:
        raise ValueError(
            f"num_warmup_iterations = {w.num_warmup_iterations} must be below "
            f"num_iterations = {w.num_iterations} (at least one iteration is measured)"
        )
    if not w.report_interval_s > 0:
        raise ValueError(f"report_interval_s = {w.report_interval_s!r} must be > 0")


def _tp_sizes(w: Workload) -> None:
    num_gpus, per_node = w.cluster.num_gpus, w.cluster.num_gpus_per_node
    for section in ("rollout", "inference", "trainer"):
        tp = getattr(w, section).tp
        where = f"[{section}] tp = {tp}"
        if tp > num_gpus:
            raise ValueError(f"{where} exceeds the cluster's [cluster] num_gpus = {num_gpus}")
        if tp > per_node:
            raise ValueError(
                f"{where} exceeds [cluster] num_gpus_per_node = {per_node} "
                "(a TP group never spans nodes)"
            )
        if per_node % tp:
            raise ValueError(
                f"{where} must divide [cluster] num_gpus_per_node = {per_node} "
                "(TP groups tile a node)"
            )


def _roles(w: Workload) -> None:
    if w.trainer.fused:
        raise ValueError(
            f"[trainer] tokens_per_s_per_gpu = {w.trainer.tokens_per_s_per_gpu!r}: only "
            "[inference] may be fused (into the trainer); the trainer needs GPUs"
        )
    if w.inference.parkable:
        raise ValueError(
            "[inference] parkable = true: only the trainer parks (its state waits in host "
            "memory); set it false"
        )


def _minimums(w: Workload) -> None:
    inference, trainer = smallest_replica(w.inference), smallest_replica(w.trainer)
    need = w.rollout.tp + inference + trainer
    if need > w.cluster.num_gpus:
        raise ValueError(
            f"the components' minimums need {need} GPUs side by side, more than "
            f"[cluster] num_gpus = {w.cluster.num_gpus}: one rollout engine "
            f"([rollout] tp = {w.rollout.tp}), inference {inference} ([inference] "
            f"min_gpus = {w.inference.min_gpus}, tp = {w.inference.tp}) and the trainer "
            f"{trainer} ([trainer] min_gpus = {w.trainer.min_gpus}, tp = {w.trainer.tp})"
        )


def _lengths(w: Workload) -> None:
    max_seq, median = w.batch.max_seq_len, w.lengths.prompt_median
    if max_seq // 4 < median:
        raise ValueError(
            f"[batch] max_seq_len = {max_seq} is too short for [lengths] prompt_median = "
            f"{median!r}: the trace clips prompts at max_seq_len // 4 = {max_seq // 4} "
            f"tokens, so most prompts would be cut; need max_seq_len >= {4 * median:g}"
        )
    kv = w.rollout.kv_capacity_tokens
    if kv < max_seq:
        raise ValueError(
            f"[rollout] kv_capacity_tokens = {kv} cannot hold one sequence of "
            f"[batch] max_seq_len = {max_seq}"
        )


def _memory(w: Workload) -> None:
    gib = w.cluster.gpu_memory_gib
    memory = gib * GIB
    weights = 2.0 * w.model.num_params  # bf16
    ro = w.rollout
    engine = (weights + ro.kv_capacity_tokens * w.model.kv_bytes_per_token) / ro.tp
    if engine > memory:
        raise ValueError(
            f"a rollout engine needs {engine / GIB:.1f} GiB a GPU (bf16 weights of [model] "
            f"num_params = {w.model.num_params:g} and [rollout] kv_capacity_tokens = "
            f"{ro.kv_capacity_tokens} × [model] kv_bytes_per_token = "
            f"{w.model.kv_bytes_per_token}, over [rollout] tp = {ro.tp}), more than "
            f"[cluster] gpu_memory_gib = {gib!r}"
        )
    if not w.inference.fused and weights / w.inference.tp > memory:
        raise ValueError(
            f"an inference replica needs {weights / w.inference.tp / GIB:.1f} GiB a GPU for "
            f"its bf16 weights over [inference] tp = {w.inference.tp}, more than "
            f"[cluster] gpu_memory_gib = {gib!r}"
        )
    smallest = smallest_replica(w.trainer)
    state = trainer_bytes_per_gpu(w, smallest)
    if state > memory:
        raise ValueError(
            f"the trainer's state needs {state / GIB:.1f} GiB a GPU on its smallest size, "
            f"{smallest} GPUs ([trainer] min_gpus = {w.trainer.min_gpus}, tp = "
            f"{w.trainer.tp}; [model] num_params × state_bytes_per_param, "
            f"sharded_state_fraction = {w.model.sharded_state_fraction!r}), more than "
            f"[cluster] gpu_memory_gib = {gib!r}: raise [trainer] min_gpus"
        )


def _scheduler(w: Workload) -> None:
    per_node = w.cluster.num_gpus_per_node
    if w.scheduler.num_devices_per_node != per_node:
        raise ValueError(
            f"[scheduler] num_devices_per_node = {w.scheduler.num_devices_per_node} must "
            f"equal [cluster] num_gpus_per_node = {per_node} (leave it out to take the "
            "cluster's)"
        )
    memory = round(w.cluster.gpu_memory_gib * GIB)
    if w.scheduler.device_memory_bytes != memory:
        raise ValueError(
            f"[scheduler] device_memory_bytes = {w.scheduler.device_memory_bytes} must "
            f"equal [cluster] gpu_memory_gib = {w.cluster.gpu_memory_gib!r} GiB "
            f"({memory} bytes; leave it out to take the cluster's)"
        )
