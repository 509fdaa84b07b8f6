"""SGLang rollout engines driven over SGLang 0.5.23's native HTTP API (extra ``sglang``).

- :class:`SGLangClient` — typed async calls with deadlines and bounded, idempotency-aware
  retries; :class:`SGLangEngine` — a rollout engine (idle-safe memory release, reusable
  prefix reported per request, ``/v1/loads`` → :class:`~dynarl.bus.WorkerMetrics`);
- :mod:`.steps` — workload drain and hybrid activate/deactivate as plans of steps;
- :class:`SGLangServer` — launch and stop ``python -m sglang.launch_server``;
- weight sync: :mod:`.hf_layout` (Megatron ↔ HF names and layouts), :mod:`.buckets`
  (flattened buckets), :mod:`.weight_sync` (group, broadcast and HTTP sequence) and
  :mod:`.weight_check` (the ``/weights_checker`` figures computed on the trainer's side).

Tested against :class:`dynarl.testing.FakeSGLangServer` on CPU, and against a real server
when ``DYNARL_SGLANG_URL`` is set.
"""

from __future__ import annotations

from dynarl.backends.sglang.buckets import (
    Bucket,
    TensorMeta,
    dtype_from_name,
    flatten_bucket,
    plan_buckets,
    tensor_meta,
    unflatten_bucket,
)
from dynarl.backends.sglang.client import (
    ClientConfig,
    SGLangClient,
)
from dynarl.backends.sglang.engine import (
    CachedTokensSink,
    SGLangEngine,
    continuation,
    merge_results,
    rollout_report,
    worker_metrics,
)
from dynarl.backends.sglang.hf_layout import (
    GPTLayout,
    hf_to_megatron,
    megatron_to_hf,
    merge_gated_fc1,
    merge_qkv,
    partition_dim,
    split_gated_fc1,
    split_qkv,
)
from dynarl.backends.sglang.launcher import (
    SGLangServer,
    SGLangServerConfig,
    free_port,
    launch_command,
)
from dynarl.backends.sglang.steps import (
    AddToRouting,
    Continue,
    EngineControl,
    Pause,
    ReleaseMemory,
    RemoveFromRouting,
    ResumeMemory,
    Router,
    Step,
    SyncWeights,
    WaitIdle,
    execute_steps,
    plan_activate,
    plan_deactivate,
    plan_workload_drain,
)
from dynarl.backends.sglang.weight_check import (
    ExpectedChecksums,
    HashDevice,
    checksum_mismatches,
    cpu_tensor_hash,
    cuda_tensor_hash,
    engine_checksum,
    expected_checksums,
    overall_checksum,
    sglang_rank_params,
    tensor_hash_hex,
)
from dynarl.backends.sglang.weight_sync import (
    WeightSyncConfig,
    WeightSyncPlan,
    broadcast_bucket,
    close_update_group,
    open_update_group,
    plan_weight_sync,
    push_weights,
    receive_bucket,
    receive_tensor,
)
from dynarl.backends.sglang.wire import (
    MEMORY_TAGS,
    ChecksumReply,
    ControlResult,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    LoadSnapshot,
    LoadsReply,
    MemoryMetrics,
    PauseMode,
    QueueMetrics,
    RankChecksum,
    SamplingParams,
    decode_generate_result,
)

__all__ = [
    "MEMORY_TAGS",
    "AddToRouting",
    "Bucket",
    "CachedTokensSink",
    "ChecksumReply",
    "ClientConfig",
    "Continue",
    "ControlResult",
    "EngineControl",
    "ExpectedChecksums",
    "FinishReason",
    "GPTLayout",
    "GenerateRequest",
    "GenerateResult",
    "HashDevice",
    "LoadSnapshot",
    "LoadsReply",
    "MemoryMetrics",
    "Pause",
    "PauseMode",
    "QueueMetrics",
    "RankChecksum",
    "ReleaseMemory",
    "RemoveFromRouting",
    "ResumeMemory",
    "Router",
    "SGLangClient",
    "SGLangEngine",
    "SGLangServer",
    "SGLangServerConfig",
    "SamplingParams",
    "Step",
    "SyncWeights",
    "TensorMeta",
    "WaitIdle",
    "WeightSyncConfig",
    "WeightSyncPlan",
    "broadcast_bucket",
    "checksum_mismatches",
    "close_update_group",
    "continuation",
    "cpu_tensor_hash",
    "cuda_tensor_hash",
    "decode_generate_result",
    "dtype_from_name",
    "engine_checksum",
    "execute_steps",
    "expected_checksums",
    "flatten_bucket",
    "free_port",
    "hf_to_megatron",
    "launch_command",
    "megatron_to_hf",
    "merge_gated_fc1",
    "merge_qkv",
    "merge_results",
    "open_update_group",
    "overall_checksum",
    "partition_dim",
    "plan_activate",
    "plan_buckets",
    "plan_deactivate",
    "plan_weight_sync",
    "plan_workload_drain",
    "push_weights",
    "receive_bucket",
    "receive_tensor",
    "rollout_report",
    "sglang_rank_params",
    "split_gated_fc1",
    "split_qkv",
    "tensor_hash_hex",
    "tensor_meta",
    "unflatten_bucket",
    "worker_metrics",
]
