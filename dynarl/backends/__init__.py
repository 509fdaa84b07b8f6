"""Engines and trainers dynarl drives: the CPU reference backend (:mod:`.reference`), the
SGLang and vLLM clients and launchers (:mod:`.sglang`, :mod:`.vllm`) and the Megatron-core
trainer (:mod:`.megatron`).

What both trainers share is here: GRPO's math as pure functions
(:func:`group_advantages`, :func:`policy_loss`), the unit they consume
(:class:`TrainSample`), its settings (:class:`GRPOConfig`) and what a step reports
(:class:`StepStats`). Importing this package imports torch, not a backend.
"""

from __future__ import annotations

from dynarl.backends._grpo import (
    GRPOConfig,
    StepStats,
    TrainSample,
    group_advantages,
    policy_loss,
)

__all__ = ["GRPOConfig", "StepStats", "TrainSample", "group_advantages", "policy_loss"]
