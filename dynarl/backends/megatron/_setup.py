"""What the Megatron trainer role needs to know: :class:`MegatronSetup`.

One frozen description — model, training settings, initial weights, parallel sizes — that
travels to the worker processes as a single component option (JSON text; options are
scalars) and is decoded there by each role instance, and by the controller's cost model
for the layouts (:meth:`MegatronSetup.layout`). Pure data; the layouts read the model's
description (:func:`~dynarl.backends.megatron.describe`: imports Megatron, once per model).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynarl.backends._json_option import json_option, read_json_option
from dynarl.backends.megatron._gpt_model import describe
from dynarl.backends.megatron._hf_checkpoint import model_config_from_hf
from dynarl.backends.megatron._layout_rules import model_layout_spec
from dynarl.backends.megatron._train_config import GPTModelConfig, MegatronTrainConfig
from dynarl.bus import MetaValue
from dynarl.migrate import Layout, LayoutSpec, ParamSpec, trainer_layout

__all__ = ["MEGATRON_OPTION", "MegatronSetup"]

MEGATRON_OPTION = "megatron"
"""The component option that carries a :class:`MegatronSetup` as JSON."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronSetup:
    """A Megatron-core trainer component, as its roles see it."""

    model: GPTModelConfig
    """Architecture."""
    train: MegatronTrainConfig = field(default_factory=MegatronTrainConfig)
    """Optimizer, batching and loss settings (with ``grpo.kl_coef > 0`` the role scores
    every micro-batch under the frozen initial weights: :class:`ReferencePolicy`)."""
    hf_path: str = ""
    """Initial weights: a local Hugging Face checkpoint directory of ``model``; "" draws
    them from ``model.init_seed`` (the same for every layout)."""
    tp: int = 1
    """Tensor-parallel size of every layout."""
    pp: int = 1
    """Pipeline-parallel size of every layout (streamed steps need 1)."""
    distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks (Megatron's; CUDA only)."""
    num_threads: int = 0
    """Torch intra-op threads of each worker that hosts the role (process-wide; 0: leave
    torch's setting). Data-parallel ranks give bitwise-equal rows only with equal
    settings."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.num_threads < 0:
            raise ValueError("MegatronSetup needs tp >= 1, pp >= 1 and num_threads >= 0")

    @classmethod
    def from_hf(cls, path: str | Path, **fields: Any) -> MegatronSetup:
        """The setup of an HF checkpoint directory: its ``config.json`` as the model, its
        weights as the initial ones; ``fields`` set the rest. Raises ValueError for a
        model the trainer cannot express."""
        config = json.loads((Path(path) / "config.json").read_text())
        return cls(model=model_config_from_hf(config), hf_path=str(path), **fields)

    def to_options(self) -> dict[str, MetaValue]:
        """The component options that carry this setup."""
        return json_option(MEGATRON_OPTION, self)

    @classmethod
    def from_options(cls, options: Mapping[str, MetaValue]) -> MegatronSetup:
        """The setup in a component's options; ValueError if it is missing or malformed."""
        return read_json_option(options, MEGATRON_OPTION, cls, "Megatron setup")

    def param_specs(self) -> list[ParamSpec]:
        """The model's description (cached per model in this process)."""
        return list(_describe(self.model))

    def layout_spec(self, devices: Sequence[int]) -> LayoutSpec:
        """The layout spec over ``devices``: data parallel over what TP × PP leaves (no
        expert parallelism: the role's streamed steps run each micro-batch on one rank;
        sequence parallel for a MoE model with TP). Raises ValueError unless the number of
        devices is a positive multiple of TP × PP."""
        unit = self.tp * self.pp
        if not devices or len(devices) % unit:
            raise ValueError(
                f"{len(devices)} devices do not split into tp={self.tp} x pp={self.pp}"
            )
        return model_layout_spec(
            self.model,
            devices,
            tp=self.tp,
            pp=self.pp,
            dp=len(devices) // unit,
            distributed_optimizer=self.distributed_optimizer,
        )

    def layout(self, devices: Sequence[int]) -> Layout:
        """The trainer state's layout over ``devices`` (the one a MegatronTrainer builds)."""
        return trainer_layout(self.param_specs(), self.layout_spec(devices))


@functools.lru_cache(maxsize=8)
def _describe(model: GPTModelConfig) -> tuple[ParamSpec, ...]:
    return tuple(describe(model))
