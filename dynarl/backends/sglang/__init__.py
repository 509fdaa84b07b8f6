"""SGLang rollout engines driven over SGLang 0.5.23's native HTTP API (extra ``sglang``).

- :class:`SGLangClient` — typed async calls with deadlines and bounded, idempotency-aware
  retries; :class:`~._sglang_engine.SGLangEngine` — a rollout engine (idle-safe memory
  release, reusable prefix reported per request, ``/v1/loads`` →
  :class:`~dynarl.bus.WorkerMetrics`);
- :mod:`._control_steps` — workload drain and hybrid activate/deactivate as plans of steps;
- :class:`~._server_launcher.SGLangServer` — launch and stop
  ``python -m sglang.launch_server``;
- weight sync: :mod:`._hf_layout` (Megatron ↔ HF names and layouts), :mod:`._buckets`
  (flattened buckets), :mod:`._weight_sync` (group, broadcast and HTTP sequence) and
  :mod:`._weight_check` (the ``/weights_checker`` figures computed on the trainer's side).

Tested against :class:`dynarl.testing.FakeSGLangServer` on CPU, and against a real server
when ``DYNARL_SGLANG_URL`` is set.
"""

from __future__ import annotations

from dynarl.backends.sglang._buckets import Bucket, TensorMeta, dtype_from_name
from dynarl.backends.sglang._client import SGLangClient
from dynarl.backends.sglang._hf_layout import GPTLayout, hf_to_megatron, megatron_to_hf
from dynarl.backends.sglang._weight_check import (
    ExpectedChecksums,
    HashDevice,
    checksum_mismatches,
    engine_checksum,
    expected_checksums,
    overall_checksum,
    sglang_rank_params,
    tensor_hash_hex,
)
from dynarl.backends.sglang._weight_sync import (
    WeightSyncConfig,
    close_update_group,
    open_update_group,
    plan_weight_sync,
    push_weights,
    receive_bucket,
    receive_tensor,
)

__all__ = [
    "Bucket",
    "ExpectedChecksums",
    "GPTLayout",
    "HashDevice",
    "SGLangClient",
    "TensorMeta",
    "WeightSyncConfig",
    "checksum_mismatches",
    "close_update_group",
    "dtype_from_name",
    "engine_checksum",
    "expected_checksums",
    "hf_to_megatron",
    "megatron_to_hf",
    "open_update_group",
    "overall_checksum",
    "plan_weight_sync",
    "push_weights",
    "receive_bucket",
    "receive_tensor",
    "sglang_rank_params",
    "tensor_hash_hex",
]
