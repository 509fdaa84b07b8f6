"""vLLM rollout engines driven over vLLM 0.32's HTTP API in dev mode (extra ``vllm``; the
client needs only ``aiohttp``, and vLLM may live in an environment of its own).

- :class:`VLLMServer` — launch and stop ``python -m vllm.entrypoints.openai.api_server``
  (its own process group, a parent-death signal, a bounded ``/health`` wait, the log kept
  in a run directory);
- :class:`VLLMEngine` — one server as the engine the serving role drives
  (:mod:`dynarl.backends.serving`), launched or attached;
- :class:`VLLMInProcessEngine` — vLLM's ``AsyncLLM`` inside the calling process as the
  same engine (no HTTP; its engine core is still a child process), built from the config a
  server would get;
- :class:`VLLMClient` — typed async calls with deadlines: generate from token ids
  (:class:`GenerateRequest` → :class:`GenerateResult`: token ids, per-token log-probs,
  weight versions as :class:`WeightVersionSpan`), abort one or all (the waiting call gets
  the partial token ids), pause and resume, ``/metrics`` as :class:`VLLMLoad`,
  prefix-cache reset, weight-version labels.

- :class:`WeightPusher` — push a trainer's tensors into running engines over a gloo
  (NCCL) group that the engines' workers join through
  :mod:`dynarl.backends.vllm.worker_extension`.

dynarl's priorities run higher first; vLLM's lower first. :class:`GenerateRequest` takes
dynarl's, and the sign is flipped on the wire in one place (``_wire.vllm_priority``).
Measured behaviour of the server: ``docs/engines.md``.
"""

from __future__ import annotations

from dynarl.backends.vllm._client import VLLMClient, VLLMClientConfig
from dynarl.backends.vllm._engine import VLLMEngine
from dynarl.backends.vllm._inprocess import VLLMInProcessEngine
from dynarl.backends.vllm._launcher import VLLMServer, VLLMServerConfig, missing_vllm
from dynarl.backends.vllm._weight_push import PushReport, WeightPusher
from dynarl.backends.vllm._wire import (
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
    VLLMLoad,
    WeightVersionSpan,
)

__all__ = [
    "GenerateRequest",
    "GenerateResult",
    "PauseMode",
    "PushReport",
    "SamplingParams",
    "VLLMClient",
    "VLLMClientConfig",
    "VLLMEngine",
    "VLLMInProcessEngine",
    "VLLMLoad",
    "VLLMServer",
    "VLLMServerConfig",
    "WeightPusher",
    "WeightVersionSpan",
    "missing_vllm",
]
