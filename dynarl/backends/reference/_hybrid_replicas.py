"""Hybrid rollout replicas on the trainer's devices of a reference job (verl-style).

:class:`JobReplicas` is the :class:`~dynarl.sched._replicas.HybridReplicas` the
:class:`~dynarl.sched.HybridController` drives, carried out on a :class:`dynarl.Job`
with a ``rollout`` component (the standalone engines, plus the hybrid ones while
active) and a ``trainer`` component (its state on the hybrid devices):

* ``sync_hybrid_weights``: the trainer copies its parameters into its worker's shared
  slot (a local transfer planned by the migrate planner, the version with it);
* ``add_replicas``: one reallocation — the trainer sleeps in place (its state offloaded,
  the device returned), then the rollout role wakes on the hybrid devices with the
  weights left in the slot and joins the load balancer;
* ``resume_generation_replicas``: every engine is checked to hold the trainer's version,
  then the driver's producer may fill the larger capacity;
* ``remove_replicas``: the dispatcher stops routing to the hybrid devices (cut first:
  nothing can be retried onto a dying replica);
* ``abort_replicas``: their in-flight requests are aborted and come back with their
  partial output (tokens, log-probs, per-token versions), re-dispatched to the
  standalone engines, which continue them;
* ``sleep_replicas``: one reallocation — the rollout role on the hybrid devices is
  released (KV cache and weights freed), then the trainer wakes in place;
* ``rebalance``: the standalone engines' in-flight requests are aborted and
  re-dispatched over every active engine (least-loaded routing).

Every operation is appended to :attr:`JobReplicas.log` with the training step, so the
orders can be checked. Runs on the driver's event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from dynarl.errors import BackendError
from dynarl.runtime import Job
from dynarl.runtime.controller import Dispatcher
from dynarl.types import Allocation

__all__ = ["JobReplicas"]

logger = logging.getLogger(__name__)


class JobReplicas:
    """The hybrid replicas of ``job`` (see the module docstring).

    ``version``: the trainer's current weight version (read when checking engines);
    ``wait_for_samples``: the message queue's wait; ``on_change``: called whenever the
    rollout's capacity changed (the producer's cue).
    """

    def __init__(
        self,
        job: Job,
        *,
        standalone: Sequence[int],
        hybrid: Sequence[int],
        version: Callable[[], int],
        wait_for_samples: Callable[[int], Awaitable[None]],
        on_change: Callable[[], None],
    ) -> None:
        if not standalone:
            raise ValueError("JobReplicas needs at least one standalone device")
        self.job = job
        self.standalone, self.hybrid = tuple(standalone), tuple(hybrid)
        self._version, self._wait, self._on_change = version, wait_for_samples, on_change
        self.log: list[tuple[str, int]] = []
        """(operation, trainer weight version) in the order performed."""
        self.aborted: list[tuple[str, int, int]] = []
        """(request id, tokens generated so far, trainer version) of every request aborted
        on a hybrid replica at a deactivation (and resumed on a standalone engine)."""
        self.rebalanced = 0
        """Requests aborted and re-dispatched by rebalances."""
        self.timeline: list[tuple[float, dict[str, int]]] = []
        """(monotonic time, devices per component) after every reallocation."""

    @property
    def dispatcher(self) -> Dispatcher:
        """The rollout's load balancer."""
        dispatcher = self.job.controller.manager("rollout").dispatcher
        assert dispatcher is not None, "the rollout component serves"
        return dispatcher

    def _note(self, operation: str) -> None:
        self.log.append((operation, self._version()))
        logger.info("hybrid replicas %s: %s", list(self.hybrid), operation)

    async def _reach(self, target: Allocation) -> None:
        if self.job.allocation == target:
            return
        outcome = await self.job.reallocate(target)
        if not outcome.ok:
            raise BackendError(f"move to {target.as_dict()} failed: {outcome.reason}")
        counts = {n: len(d) for n, d in self.job.allocation.as_dict().items()}
        self.timeline.append((time.monotonic(), counts))
        self._on_change()

    # ------------------------------------------------------------------ activation

    async def sync_hybrid_weights(self, global_steps: int) -> None:
        """The trainer's parameters into its workers' shared slots (local copies)."""
        self._note("sync_hybrid_weights")
        targets = ",".join(map(str, self.hybrid))
        tag = f"hybrid-s{global_steps}-v{self._version()}"
        await self.job.call("trainer", "sync_weights", rollout=targets, tag=tag)

    async def add_replicas(self) -> None:
        """Trainer asleep in place, rollout roles awake on the hybrid devices (routed)."""
        self._note("add_replicas")
        devices = self.standalone + self.hybrid
        await self._reach(Allocation.of({"rollout": devices, "trainer": ()}))

    async def resume_generation_replicas(self) -> None:
        """Check every engine holds the trainer's version; let requests flow to them.

        Raises BackendError for an engine on another version."""
        self._note("resume_generation_replicas")
        results = await self.job.call("rollout", "weight_version")
        held = {r.device: r.values.get("version") for r in results}
        if any(v != self._version() for v in held.values()):
            raise BackendError(f"engines hold versions {held}, expected {self._version()}")
        self._on_change()

    async def rebalance(self) -> None:
        """Abort the standalone engines' requests and route them over every engine."""
        self._note("rebalance")
        dispatcher = self.dispatcher
        await dispatcher.stop_routing(self.standalone)
        partials = await dispatcher.abort_inflight(self.standalone)
        for device in self.standalone:
            dispatcher.add_worker(device)
        await dispatcher.redispatch(partials, self.standalone + self.hybrid)
        self.rebalanced += len(partials)

    # ------------------------------------------------------------------ deactivation

    async def remove_replicas(self) -> None:
        """Stop routing to the hybrid engines."""
        self._note("remove_replicas")
        await self.dispatcher.stop_routing(self.hybrid)
        self._on_change()

    async def abort_replicas(self) -> None:
        """Abort their in-flight requests; continue them on the standalone engines."""
        self._note("abort_replicas")
        dispatcher = self.dispatcher
        partials = await dispatcher.abort_inflight(self.hybrid)
        await dispatcher.redispatch(partials, self.standalone)
        version = self._version()
        self.aborted += [(p.request_id, len(p.generated), version) for p in partials]
        logger.info("%d requests aborted on hybrid replicas, resumed", len(partials))

    async def sleep_replicas(self) -> None:
        """Rollout roles released on the hybrid devices; the trainer wakes there."""
        self._note("sleep_replicas")
        target = Allocation.of({"rollout": self.standalone, "trainer": self.hybrid})
        await self._reach(target)

    # ------------------------------------------------------------------ samples

    async def wait_for_samples(self, count: int) -> None:
        """Return once the message queue holds ``count`` samples."""
        await self._wait(count)
