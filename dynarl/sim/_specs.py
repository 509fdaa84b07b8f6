"""The parts of a workload: cluster, model, batch, lengths, engines, stages, costs.

Each TOML table of a workload file (``docs/workloads.md``) maps to one frozen dataclass
here; every field is range-checked when it is built. A bad value raises a ``ValueError``
(:class:`~dynarl.errors.ConfigValueError`) that names each key involved and its
value, after its class (``StageSpec.min_gpus = 6``); the workload reader names them as the
file does (``[trainer] min_gpus = 6``). Pure data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dynarl.errors import ConfigValueError

__all__ = [
    "AgenticSpec",
    "BatchSpec",
    "ClusterSpec",
    "LengthSpec",
    "MigrationSpec",
    "ModelSpec",
    "RolloutSpec",
    "StageSpec",
    "VerlSpec",
]


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not _number(value) or not value > 0:
            raise ConfigValueError(owner, f"{{{name}}} must be a positive number", **{name: value})


def _non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not _number(value) or not value >= 0:
            raise ConfigValueError(owner, f"{{{name}}} must be >= 0", **{name: value})


def _fraction(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not _number(value) or not 0.0 <= value <= 1.0:
            raise ConfigValueError(owner, f"{{{name}}} must be in [0, 1]", **{name: value})


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """The GPUs of the job."""

    num_gpus: int
    """GPUs in the job."""
    num_gpus_per_node: int = 8
    """GPUs per node (TP groups never span nodes)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU, GiB."""

    def __post_init__(self) -> None:
        owner = "ClusterSpec."
        _positive(owner, num_gpus=self.num_gpus, num_gpus_per_node=self.num_gpus_per_node)
        _positive(owner, gpu_memory_gib=self.gpu_memory_gib)
        if self.num_gpus % self.num_gpus_per_node:
            raise ConfigValueError(
                owner,
                "{num_gpus} must be a multiple of {num_gpus_per_node} (whole nodes)",
                num_gpus=self.num_gpus,
                num_gpus_per_node=self.num_gpus_per_node,
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """The policy model."""

    name: str
    """Label (for example ``7b``)."""
    num_params: float
    """Parameters."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Hidden size."""
    kv_bytes_per_token: int
    """KV-cache bytes of one token (all layers, K and V, bf16)."""
    state_bytes_per_param: float = 16.0
    """Trainer state per parameter: bf16 weights and grads, fp32 master and Adam moments."""
    sharded_state_fraction: float = 0.75
    """Part of the trainer state the distributed optimizer shards over DP ranks."""

    def __post_init__(self) -> None:
        owner = "ModelSpec."
        _positive(owner, num_params=self.num_params, num_layers=self.num_layers)
        _positive(owner, hidden_size=self.hidden_size, kv_bytes_per_token=self.kv_bytes_per_token)
        _positive(owner, state_bytes_per_param=self.state_bytes_per_param)
        _fraction(owner, sharded_state_fraction=self.sharded_state_fraction)

    @property
    def state_bytes(self) -> int:
        """Bytes of one full replica of the trainer state."""
        return int(self.num_params * self.state_bytes_per_param)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSpec:
    """One training iteration's batch."""

    num_prompts: int
    """Prompts per iteration (rollout batch)."""
    group_size: int
    """Samples per prompt (GRPO group)."""
    num_minibatches: int
    """Trainer mini-batches (optimizer steps) per iteration."""
    max_seq_len: int
    """Longest sequence, prompt included, tokens."""

    def __post_init__(self) -> None:
        owner = "BatchSpec."
        _positive(owner, num_prompts=self.num_prompts, group_size=self.group_size)
        _positive(owner, num_minibatches=self.num_minibatches, max_seq_len=self.max_seq_len)
        if self.num_prompts % self.num_minibatches:
            raise ConfigValueError(
                owner,
                "{num_prompts} must be a multiple of {num_minibatches}"
                " (a mini-batch holds whole GRPO groups)",
                num_prompts=self.num_prompts,
                num_minibatches=self.num_minibatches,
            )

    @property
    def num_samples(self) -> int:
        """Samples (sequences or episodes) per iteration."""
        return self.num_prompts * self.group_size


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthSpec:
    """Prompt and output lengths: log-normal, clipped to the sequence limit."""

    prompt_median: float
    """Median prompt length, tokens."""
    prompt_sigma: float
    """Log-space standard deviation of prompt lengths."""
    output_median: float
    """Median output length (agentic: of the first turn), tokens."""
    output_sigma: float
    """Log-space standard deviation of output lengths (the heavy tail)."""

    def __post_init__(self) -> None:
        owner = "LengthSpec."
        _positive(owner, prompt_median=self.prompt_median, output_median=self.output_median)
        _non_negative(owner, prompt_sigma=self.prompt_sigma, output_sigma=self.output_sigma)


@dataclass(frozen=True, kw_only=True, slots=True)
class AgenticSpec:
    """Multi-turn episodes: turns, tool latency, observations."""

    mean_tool_calls: float
    """Mean tool calls per episode (geometric, so heavily skewed)."""
    max_tool_calls: int
    """Most tool calls of one episode."""
    turn_decay: float
    """Median output of turn k is ``output_median × turn_decay**k`` (later turns shorter)."""
    tool_latency_median_s: float
    """Median tool latency, seconds."""
    tool_latency_sigma: float
    """Log-space standard deviation of tool latency."""
    tool_timeout_s: float
    """Tool calls end by this time, seconds."""
    observation_median: float
    """Median tokens a tool result adds to the context."""
    observation_sigma: float
    """Log-space standard deviation of observation lengths."""

    def __post_init__(self) -> None:
        owner = "AgenticSpec."
        _non_negative(owner, mean_tool_calls=self.mean_tool_calls)
        _positive(owner, tool_latency_median_s=self.tool_latency_median_s)
        _positive(owner, tool_timeout_s=self.tool_timeout_s, turn_decay=self.turn_decay)
        _positive(owner, observation_median=self.observation_median)
        _non_negative(owner, max_tool_calls=self.max_tool_calls)
        _non_negative(owner, tool_latency_sigma=self.tool_latency_sigma)
        _non_negative(owner, observation_sigma=self.observation_sigma)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutSpec:
    """One rollout engine: continuous batching with a KV budget and a decode-step curve.

    A decode step (one token for every running request) takes
    ``step_fixed_s + step_per_seq_s × batch + step_per_kv_token_s × active KV tokens``.
    """

    tp: int
    """GPUs per engine (tensor parallel)."""
    kv_capacity_tokens: int
    """KV-cache tokens one engine holds (running requests plus cached prefixes)."""
    max_running_requests: int
    """Most requests one engine runs at once."""
    step_fixed_s: float
    """Decode step time independent of the batch (weights read, launch, sampling), s."""
    step_per_seq_s: float
    """Decode step time per running request (compute), s."""
    step_per_kv_token_s: float
    """Decode step time per active KV token (attention reads), s."""
    prefill_tokens_per_s: float
    """Prefill speed of one engine; decoding stalls while it prefills."""
    new_token_ratio: float = 0.7
    """SGLang's initial share of a request's future tokens reserved at admission."""
    min_new_token_ratio: float = 0.1
    """The floor that share decays to."""
    new_token_ratio_decay_steps: int = 600
    """Decode steps the share takes to decay from initial to floor."""
    clip_max_new_tokens: int = 4096
    """Future tokens counted per request at most, before the ratio."""
    retract_decode_steps: int = 20
    """Steps of headroom a retraction frees (SGLang's retract_decode_steps)."""
    cache_block_tokens: int = 1
    """Granularity of prefix reuse: a cached prefix serves whole blocks of this many tokens
    only (SGLang's radix cache: 1; vLLM caches full KV blocks, 128 tokens on its CPU
    backend). The per-request model only (``vector`` runs need 1)."""
    request_overhead_s: float = 0.0
    """Seconds a turn's output takes to reach its caller beyond the engine (the serving
    stack's round trip: HTTP, the dispatcher, the bus), so its episode's next turn or end
    comes this much later. 0: the caller sits beside the engine (the validated model)."""
    shared_prefix: bool = False
    """The prefix cache as the engines keep it: a group prompt's KV is held once while its
    siblings run on it (pinned: not evictable in use) and a prefix is evicted from its tail
    (its head still serves). False: every running request holds its whole prompt and a
    prefix is evicted whole — the model the shipped workloads were validated with. The
    per-request model only (``vector`` runs need False)."""
    prefix_cached_after_prefill: bool = False
    """When a group prompt enters the prefix cache. True (SGLang's radix cache: a request's
    KV is inserted into the tree after its prefill forward): siblings admitted in the same
    prefill batch each compute the prompt and only later ones reuse it. False (vLLM's block
    pool hashes a request's blocks when it is scheduled): a sibling admitted in the same
    step already hits them. Measured on both engines (``bench/priority.py``, issue 20). The
    per-request model only (``vector`` runs need False)."""

    def __post_init__(self) -> None:
        owner = "RolloutSpec."
        _positive(owner, tp=self.tp, kv_capacity_tokens=self.kv_capacity_tokens)
        _positive(owner, max_running_requests=self.max_running_requests)
        _positive(owner, step_fixed_s=self.step_fixed_s)
        _non_negative(owner, step_per_seq_s=self.step_per_seq_s)
        _non_negative(owner, step_per_kv_token_s=self.step_per_kv_token_s)
        _positive(owner, prefill_tokens_per_s=self.prefill_tokens_per_s)
        _positive(owner, new_token_ratio_decay_steps=self.new_token_ratio_decay_steps)
        _non_negative(owner, clip_max_new_tokens=self.clip_max_new_tokens)
        _non_negative(owner, retract_decode_steps=self.retract_decode_steps)
        _positive(owner, cache_block_tokens=self.cache_block_tokens)
        _non_negative(owner, request_overhead_s=self.request_overhead_s)
        _fraction(owner, new_token_ratio=self.new_token_ratio)
        _fraction(owner, min_new_token_ratio=self.min_new_token_ratio)
        if self.min_new_token_ratio > self.new_token_ratio:
            raise ConfigValueError(
                owner,
                "{min_new_token_ratio} must not exceed {new_token_ratio}",
                min_new_token_ratio=self.min_new_token_ratio,
                new_token_ratio=self.new_token_ratio,
            )

    def step_time(self, batch: float, kv_tokens: float) -> float:
        """Seconds of one decode step of ``batch`` requests holding ``kv_tokens``."""
        return (
            self.step_fixed_s + self.step_per_seq_s * batch + self.step_per_kv_token_s * kv_tokens
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """A fluid stage (log-prob inference or the trainer): tokens/s as a function of GPUs.

    Throughput on ``n`` GPUs is ``tokens_per_s_per_gpu × n ** scaling_exponent``. An
    infinite ``tokens_per_s_per_gpu`` is a stage fused into its neighbour (a trainer that
    scores its own log-probs): it takes no time and needs no GPU (``min_gpus`` 0).
    """

    tp: int
    """GPUs per replica (tensor × pipeline parallel): the unit of a resize."""
    tokens_per_s_per_gpu: float
    """Tokens processed per second by one GPU."""
    scaling_exponent: float = 1.0
    """Exponent of the GPU count (1: linear)."""
    min_gpus: int = 0
    """Fewest GPUs the stage may hold while it holds any (memory), a multiple of tp."""
    parkable: bool = False
    """May hold no GPU although ``min_gpus`` > 0: its state then waits in host memory
    (parking and unparking cross the host links, ``[migration] host_gbps``). A workload
    lets only its trainer park."""

    def __post_init__(self) -> None:
        owner = "StageSpec."
        _positive(owner, tp=self.tp, tokens_per_s_per_gpu=self.tokens_per_s_per_gpu)
        _positive(owner, scaling_exponent=self.scaling_exponent)
        _non_negative(owner, min_gpus=self.min_gpus)
        if not isinstance(self.parkable, bool):
            raise ConfigValueError(
                owner, "{parkable} must be true or false", parkable=self.parkable
            )
        if self.min_gpus % self.tp:
            raise ConfigValueError(
                owner, "{min_gpus} must be a multiple of {tp}", min_gpus=self.min_gpus, tp=self.tp
            )
        if self.fused and self.min_gpus:
            raise ConfigValueError(
                owner,
                "{min_gpus} must be 0 for a fused stage ({tokens_per_s_per_gpu})",
                min_gpus=self.min_gpus,
                tokens_per_s_per_gpu=self.tokens_per_s_per_gpu,
            )

    @property
    def fused(self) -> bool:
        """Whether the stage takes no time and no GPU (infinite throughput)."""
        return math.isinf(self.tokens_per_s_per_gpu)

    def rate(self, num_gpus: int) -> float:
        """Tokens per second on ``num_gpus`` GPUs (0 for none; infinite when fused)."""
        if self.fused:
            return math.inf
        if num_gpus <= 0:
            return 0.0
        return self.tokens_per_s_per_gpu * math.pow(num_gpus, self.scaling_exponent)


@dataclass(frozen=True, kw_only=True, slots=True)
class MigrationSpec:
    """Modelled migration pauses, seconds (the scheduler is charged the same figures)."""

    workload_s: float
    """Workload migration of rollout or inference (stop, re-route, free, load)."""
    p2p_s: float
    """P2P reshard of the trainer."""
    reboot_s: float
    """Reboot migration (fallback)."""
    weight_sync_s: float
    """Trainer to rollout weight sync at the end of an iteration."""
    phase_switch_s: float
    """Colocated stage switch (offload one role, onload the next)."""
    host_gbps: float = 50.0
    """Host link of one GPU, GB/s: a parked stage's state crosses it when the stage parks
    or unparks, every GPU over its own link in parallel (PCIe gen5 x16)."""
    trainer_kind: Literal["p2p", "reboot"] = "p2p"
    """How the trainer is resized: ``p2p`` (resharded in place, ``p2p_s``) or ``reboot``
    (a trainer whose layout cannot be resharded: every resize to a non-zero size restarts
    it, ``reboot_s``; parking saves its state over the host links as a P2P trainer's)."""

    def __post_init__(self) -> None:
        owner = "MigrationSpec."
        _non_negative(owner, workload_s=self.workload_s, p2p_s=self.p2p_s)
        _non_negative(owner, reboot_s=self.reboot_s, weight_sync_s=self.weight_sync_s)
        _non_negative(owner, phase_switch_s=self.phase_switch_s)
        _positive(owner, host_gbps=self.host_gbps)
        if self.trainer_kind not in ("p2p", "reboot"):
            raise ConfigValueError(
                owner, "{trainer_kind} must be 'p2p' or 'reboot'", trainer_kind=self.trainer_kind
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class VerlSpec:
    """verl fully-async with hybrid replicas (its dynamic resource scheduling)."""

    deactivate_ratio: float = 0.3
    """Initial dynamic_schedule_deactivate_ratio."""
    staleness_threshold: float = 0.1
    """Samples the rollouter may run ahead, as a share of a sync cycle."""
    trigger_parameter_sync_step: int = 4
    """Collections per weight-sync cycle."""
    require_batches: int = 1
    """Mini-batches per collection."""
    clamp_ratio: bool = False
    """Clamp the adaptive ratio to [0, 1] (verl does not)."""
    enable_rebalance: bool = True
    """Rebalance in-flight requests after an activation."""

    def __post_init__(self) -> None:
        owner = "VerlSpec."
        _fraction(owner, deactivate_ratio=self.deactivate_ratio)
        _non_negative(owner, staleness_threshold=self.staleness_threshold)
        _positive(owner, trigger_parameter_sync_step=self.trigger_parameter_sync_step)
        _positive(owner, require_batches=self.require_batches)
