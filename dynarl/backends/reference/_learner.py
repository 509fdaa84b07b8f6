"""The trainer component of a reference job: :class:`ReferenceTrainer`.

The reference job trains with the production trainer: this is
:class:`~dynarl.backends.megatron.MegatronTrainerRole` configured by the job's
:class:`~dynarl.backends.reference.ReferenceSetup` — the reference architecture as a
Megatron GPTModel (:meth:`ReferenceSetup.megatron`), data parallel over the trainer's
devices, its initial weights the job's weights file. Everything else is the Megatron
role's: streamed GRPO steps (``learn`` keeps each micro-batch's gradient row on whichever
devices the trainer holds when the rollout delivers it; ``step`` sums the rows in
micro-batch order: bitwise the same update whatever the devices, DP size and arrival
order), KL to the frozen initial weights, checksums, P2P reshards, parking at zero devices.

What the reference job adds is how weights reach its engines, which are CPU decoders in
the other worker processes rather than servers: ``sync_weights(rollout=..., tag=...)``
sends the parameters, under the reference names, to the rollout devices as a reshard
planned by the migrate planner (destination: a replicated layout), and leaves a copy for
the engine of the trainer's own process in the worker's shared slot. Blocking methods run
on the worker's compute thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dynarl.backends.megatron import MegatronSetup, MegatronTrainerRole
from dynarl.backends.reference._megatron_model import from_megatron, to_megatron
from dynarl.backends.reference._setup import ReferenceSetup
from dynarl.backends.reference._weights import WEIGHTS_SLOT, run_sync, sync_plan
from dynarl.bus import MetaValue, Sample
from dynarl.errors import BackendError
from dynarl.runtime.worker import RoleContext
from dynarl.types import ComponentKind

__all__ = ["ReferenceTrainer"]


class ReferenceTrainer(MegatronTrainerRole, kind=ComponentKind.TRAINER, name="trainer"):
    """The reference job's trainer (see the module docstring); options: a
    :class:`~dynarl.backends.reference.ReferenceSetup` (``ReferenceSetup.to_options()``)."""

    def __init__(self, ctx: RoleContext) -> None:
        self.reference = ReferenceSetup.from_options(ctx.options)
        super().__init__(ctx)

    @classmethod
    def setup_of(cls, options: Mapping[str, MetaValue]) -> MegatronSetup:
        """The Megatron setup of the job's :class:`ReferenceSetup`."""
        return ReferenceSetup.from_options(options).megatron()

    def initial_state(self) -> Mapping[str, torch.Tensor] | None:
        """The job's initial weights file, under GPTModel's names."""
        return to_megatron(self.reference.initial_weights())

    def sync_weights(
        self, samples: Sequence[Sample], *, rollout: str, tag: str
    ) -> dict[str, MetaValue]:
        """Send the parameters to the rollout devices ``rollout`` (``"0,1"``), planned by
        the migrate planner; a copy for this process's own (sleeping) engine goes to the
        worker's shared slot. Every trainer rank holds the whole model (data parallel
        only), so each can be a source."""
        trainer = self._current()
        module = trainer.module
        if module is None:
            raise BackendError(f"trainer rank {self.ctx.device} holds no model")
        began = self._meter.begin()
        try:
            devices = [int(d) for d in rollout.split(",") if d]
            model = self.reference.model
            plan = sync_plan(model, self.ctx.devices, devices)
            params = {name: p.detach() for name, p in module.named_parameters()}
            result = run_sync(
                plan,
                model=model,
                rank=self.ctx.device,
                store=self.ctx.store,
                tag=tag,
                sources=from_megatron(params, model),
            )
        finally:
            self._meter.account(began, 0)
        version = trainer.version
        if result.state:
            self.ctx.shared[WEIGHTS_SLOT] = (version, result.state)
        sent = result.report.bytes_sent if result.report is not None else 0
        return {"version": version, "bytes_sent": sent, "local": bool(result.state)}
