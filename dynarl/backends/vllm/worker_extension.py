"""The engine side of a weight push: a mixin on vLLM's worker (``--worker-extension-cls
dynarl.backends.vllm.worker_extension.WeightReceiver``; :class:`VLLMServerConfig` sets it).

vLLM adds these methods to every worker of the server; dynarl calls them through the dev-mode
``/collective_rpc`` endpoint, each argument a JSON text: join the push group
(:class:`~dynarl.backends.vllm._weight_group.GroupSpec`), receive one push's tensors
(:class:`~dynarl.backends.vllm._weight_group.PushSpec`) and load them in place with vLLM's
own ``reload_weights``, leave the group. Runs inside vLLM's worker process, which must be able
to import dynarl (the same environment, or dynarl installed beside vLLM).

Dev mode's ``/collective_rpc`` runs any worker method for whoever reaches the port: see
``docs/engines.md`` on binding.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch

from dynarl.backends.vllm._weight_group import GroupSpec, PushSpec, join_group, receive_tensors
from dynarl.migrate import CommGroup

__all__ = ["WeightReceiver"]

logger = logging.getLogger(__name__)


class WeightReceiver:
    """Mixed into vLLM's worker class (which provides ``reload_weights``)."""

    _dynarl_group: CommGroup | None = None

    def dynarl_join_weight_group(self, spec: str) -> str:
        """Join the push group described by ``spec`` (a :class:`GroupSpec` as JSON); blocks
        until the pushing side has joined too."""
        group_spec = msgspec.json.decode(spec, type=GroupSpec)
        self.dynarl_leave_weight_group()
        self._dynarl_group = join_group(group_spec)
        logger.info("joined weight group %s as rank %d", group_spec.name, group_spec.rank)
        return group_spec.name

    def dynarl_receive_weights(self, spec: str) -> int:
        """Receive the tensors of ``spec`` (a :class:`PushSpec` as JSON) and load them in
        place; the number of tensors loaded."""
        group = self._dynarl_group
        if group is None:
            raise RuntimeError("dynarl_receive_weights before dynarl_join_weight_group")
        push = msgspec.json.decode(spec, type=PushSpec)
        worker: Any = self
        device = getattr(worker, "device", None) or torch.device("cpu")
        worker.reload_weights(weights_iterator=receive_tensors(group, push, device))
        return len(push.tensors)

    def dynarl_leave_weight_group(self) -> None:
        """Leave the push group, if in one."""
        group, self._dynarl_group = self._dynarl_group, None
        if group is not None:
            group.close()
