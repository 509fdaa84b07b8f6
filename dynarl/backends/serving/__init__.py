"""Real inference engines as runtime roles: one protocol over vLLM and SGLang servers.

- :class:`Engine` — what the role asks of a server-backed engine (generate from token ids
  with an id, a priority and sampling parameters → :class:`EngineOutput`: token ids,
  per-token log-probs and weight-version spans; abort one or all with the partial output
  as token ids; pause and resume; load and prefix-cache counters as :class:`EngineLoad`;
  health; start and stop). Implemented by ``dynarl.backends.vllm.VLLMEngine`` and
  ``dynarl.backends.sglang.SGLangServerEngine``;
- :class:`EngineSetup` — which engine a component runs per device, launched or attached,
  carried in its options;
- :class:`EngineRollout` — the rollout role over one engine per device, drained, aborted,
  re-dispatched and paused by the runtime as the reference engine is;
- :class:`EngineInference` — the same engines as an inference component: a ``Sample``'s
  tokens scored (:class:`ScoreRequest`: the log-prob of each token after the first).

Measured behaviour of both servers: ``docs/engines.md``.
"""

from __future__ import annotations

from dynarl.backends._engine import (
    PAUSE_MODES,
    Engine,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    FinishReason,
    PauseMode,
    ScoreRequest,
    VersionSpan,
    spans_of,
    versions_of,
)
from dynarl.backends.serving._role import (
    CACHED_TOKENS,
    EngineInference,
    EngineRollout,
    request_seed,
)
from dynarl.backends.serving._setup import SETUP_OPTION, EngineSetup

__all__ = [
    "CACHED_TOKENS",
    "PAUSE_MODES",
    "SETUP_OPTION",
    "Engine",
    "EngineInference",
    "EngineLoad",
    "EngineOutput",
    "EngineRequest",
    "EngineRollout",
    "EngineSetup",
    "FinishReason",
    "PauseMode",
    "ScoreRequest",
    "VersionSpan",
    "request_seed",
    "spans_of",
    "versions_of",
]
