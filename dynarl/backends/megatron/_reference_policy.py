"""KL's reference policy on the trainer's own devices: :class:`ReferencePolicy`.

GRPO with ``kl_coef > 0`` needs, for every trained token, its log-prob under the frozen
initial policy. The trainer role scores them itself, on the devices it holds at that
moment (the colocated reference of verl-style jobs): a second GPTModel of the same
architecture on the current layout's tensor-parallel groups, holding the initial weights
(an HF checkpoint, a reference job's weights file, or Megatron's draw from
``init_seed``), never trained. Its state is not part of the trainer's layout: a reshard
does not move it; the role rebuilds it on the new layout from the same initial weights.

Each micro-batch is scored on its own (the same inputs, padding and shapes on whichever
rank scores it), so the reference log-probs — and the gradient rows built from them —
do not depend on the data-parallel size. Runs on the role's compute thread; pipeline-
parallel layouts are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from dynarl.backends._grpo import TrainSample
from dynarl.backends.megatron._gpt_model import build_gpt, causal_inputs, token_logprobs
from dynarl.backends.megatron._megatron_trainer import MegatronTrainer
from dynarl.backends.megatron._micro_batches import micro_tensors
from dynarl.migrate import ParamSpec, param_names

__all__ = ["ReferencePolicy", "tp_slice"]


def tp_slice(full: torch.Tensor, spec: ParamSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s part of the full tensor of ``spec``, cut as
    Megatron cuts it (``tp * stride`` equal chunks along ``tp_dim``, every ``tp``-th one
    from ``tp_rank`` on, concatenated)."""
    if spec.tp_dim is None or tp == 1:
        return full
    chunks = full.chunk(tp * spec.tp_stride, dim=spec.tp_dim)
    return torch.cat(chunks[tp_rank::tp], dim=spec.tp_dim)


class ReferencePolicy:
    """The frozen initial policy on ``trainer``'s current layout (see the module docstring).

    ``initial``: the full initial weights under GPTModel's names; None draws them from the
    model's ``init_seed`` as the trainer did. Raises ValueError on a pipeline- or
    expert-parallel layout (it scores on one data-parallel rank at a time) or when
    ``initial`` lacks a parameter, BackendError outside the layout.
    """

    def __init__(self, trainer: MegatronTrainer, initial: Mapping[str, torch.Tensor] | None):
        layout, groups = trainer.layout, trainer.groups
        if layout is None or groups is None or layout.spec is None:
            raise ValueError(f"rank {trainer.rank} holds no trainer layout to score on")
        spec = layout.spec
        if spec.pp > 1 or spec.ep > 1:
            raise ValueError("the KL reference policy runs on pp=1, ep=1 layouts only")
        self.layout_spec = spec
        self.layout_name = layout.name
        self.temperature = trainer.config.temperature
        self.device = trainer.device
        module = build_gpt(
            trainer.model_config,
            spec,
            groups,
            rank=trainer.rank,
            init=initial is None,
            device=trainer.device,
        )
        if initial is not None:
            tp_rank = spec.coords(trainer.rank)[0]
            specs = {s.name: s for s in trainer.specs}
            with torch.no_grad():
                for _, name, param in list(param_names(module)):
                    if name not in initial:
                        raise ValueError(f"the initial weights lack {name!r}")
                    param.copy_(tp_slice(initial[name], specs[name], tp_rank, spec.tp))
        module.requires_grad_(False)
        self.module: torch.nn.Module | None = module.eval()

    def logprobs(self, samples: Sequence[TrainSample]) -> list[tuple[float, ...]]:
        """Per target over all tokens of each sample: its log-prob under the reference
        policy (at the training temperature). Collective over the tensor-parallel group."""
        if self.module is None:
            raise ValueError("the reference policy was closed")
        tokens, _ = micro_tensors(samples, self.layout_spec, device=self.device)
        with torch.no_grad():
            logits = self.module(tokens, *causal_inputs(tokens))
            logp = token_logprobs(logits, tokens, self.temperature).float().cpu()
        return [tuple(logp[i, : len(s.tokens) - 1].tolist()) for i, s in enumerate(samples)]

    def score(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        """``samples`` with their ``ref_logprobs`` set by :meth:`logprobs`."""
        scores = self.logprobs(samples)
        return [replace(s, ref_logprobs=ref) for s, ref in zip(samples, scores, strict=True)]

    def close(self) -> None:
        """Free the model (idempotent)."""
        self.module = None
