"""SGLang rollout engines driven over SGLang 0.5.23's native HTTP API (extra ``sglang``).

- :class:`SGLangClient` — typed async calls with deadlines and bounded, idempotency-aware
  retries; :class:`~._sglang_engine.SGLangEngine` — a rollout engine (idle-safe memory
  release, reusable prefix reported per request, ``/v1/loads`` →
  :class:`~dynarl.bus.WorkerMetrics`);
- :mod:`._control_steps` — workload drain and hybrid activate/deactivate as plans of steps;
- :class:`SGLangServer` (:class:`SGLangServerConfig`) — launch and stop
  ``python -m sglang.launch_server``;
- :class:`SGLangServerEngine` — one server as the engine the serving role drives
  (:mod:`dynarl.backends.serving`), launched or attached: token ids in, token ids,
  per-token log-probs and weight-version spans out; SGLang's priority (higher first) as it
  is; pause ``keep``/``abort``/``retract``; ``/v1/loads`` as the engine's load;
- weight sync: :mod:`._buckets` (flattened buckets), :mod:`._weight_sync` (group,
  broadcast and HTTP sequence) and :mod:`._weight_check` (the ``/weights_checker`` figures
  computed on the trainer's side); the Megatron ↔ HF names and layouts are the
  engine-neutral :mod:`dynarl.backends.hf_layout` (re-exported here for now).

Tested against :class:`dynarl.testing.FakeSGLangServer` on CPU, and against a real server
when ``DYNARL_SGLANG_URL`` is set.
"""

from __future__ import annotations

from dynarl.backends.hf_layout import GPTLayout, hf_to_megatron, megatron_to_hf
from dynarl.backends.sglang._buckets import Bucket, TensorMeta, dtype_from_name
from dynarl.backends.sglang._client import ClientConfig, SGLangClient
from dynarl.backends.sglang._server_engine import SGLangServerEngine
from dynarl.backends.sglang._server_launcher import SGLangServer, SGLangServerConfig
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
    "ClientConfig",
    "ExpectedChecksums",
    "GPTLayout",
    "HashDevice",
    "SGLangClient",
    "SGLangServer",
    "SGLangServerConfig",
    "SGLangServerEngine",
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
