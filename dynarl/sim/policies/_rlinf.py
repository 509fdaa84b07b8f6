"""RLinf's rule-based dynamic scheduling, as its open-source code decides.

Decisions happen only at the trainer's mini-batch boundaries, in the order rollout →
inference → trainer. Rollout keeps ``ceil(unfinished requests / max_running_requests)``
engines and releases, lowest engine index first, only as many as the trainer needs to
reach the next valid DP size it can; inference releases all its GPUs at once when it has
finished its work and never grows; the trainer grows to the largest valid DP size the
freed GPUs allow (only DP changes). Released rollout engines abort their requests, which
are re-submitted evenly with their partial output (KV not moved). Nothing returns to
rollout within a step; at the step's end the trainer shrinks back to its initial size and
rollout and inference get their GPUs back. Starts from the static split (valid DP).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from dynarl.bus import ComponentReport
from dynarl.sched import DeviceMove
from dynarl.sim._components import SimEvent
from dynarl.sim._profile import best_partition, rlinf_dp_sizes
from dynarl.sim._simulator import Simulation

__all__ = ["RlinfRule"]


class RlinfRule:
    """RLinf's dynamic scheduler (see the module docstring)."""

    name = "rlinf-rule"
    asynchronous = False

    def __init__(self, partition: Mapping[str, int] | None = None) -> None:
        self.partition = dict(partition) if partition is not None else None
        self.initial: dict[str, int] = {}
        self.dp_sizes: tuple[int, ...] = ()
        self.busy = False
        self.restore_pending = False
        self.lent: dict[str, set[int]] = {"rollout": set(), "inference": set(), "free": set()}

    def setup(self, sim: Simulation) -> None:
        """Place the static split; learn the valid DP sizes."""
        w = sim.workload
        self.initial = self.partition or best_partition(w)
        self.dp_sizes = rlinf_dp_sizes(w)
        sim.assign(self.initial)

    def on_reports(self, sim: Simulation, reports: Mapping[str, ComponentReport]) -> None:
        """RLinf reads no utilization signal."""

    def on_event(self, sim: Simulation, event: SimEvent, iteration: int, index: int = 0) -> None:
        """Scale at mini-batch boundaries; restore the initial split at the step's end."""
        if event is SimEvent.MINIBATCH and not self.busy:
            self._scale(sim)
        elif event is SimEvent.ITERATION_END:
            if self.busy:
                self.restore_pending = True
            else:
                self._restore(sim)

    def _scale(self, sim: Simulation) -> None:
        w = sim.workload
        mp = w.trainer.tp
        inference: tuple[int, ...] = ()
        if sim.remaining()["inference"] == 0 and sim.holders["inference"]:
            inference = tuple(sorted(sim.holders["inference"]))
        free = tuple(sorted(sim.free))
        engines = sorted(sim.rollout.engines.values(), key=lambda e: e.index)
        unfinished = sum(e.load for e in engines) + len(sim.rollout.pending)
        keep = math.ceil(unfinished / w.rollout.max_running_requests)
        releasable = max(len(engines) - keep, 0) * w.rollout.tp
        current = len(sim.holders["trainer"]) // mp
        available = len(inference) + len(free)
        reachable = [
            d for d in self.dp_sizes if d > current and (d - current) * mp <= available + releasable
        ]
        if not reachable:
            return
        need = (max(reachable) - current) * mp
        released: list[int] = []
        for engine in engines:
            if need - len(inference) - len(released) <= 0:
                break
            released += engine.devices
        take_free = free[: max(need - len(inference) - len(released), 0)]
        moves = []
        for src, devices in (("inference", inference), ("rollout", tuple(sorted(released)))):
            if devices:
                moves.append(DeviceMove(src=src, dst="trainer", devices=devices))
                self.lent[src] |= set(devices)
        if take_free:
            moves.append(DeviceMove(src=None, dst="trainer", devices=take_free))
            self.lent["free"] |= set(take_free)
        self.busy = True
        sim.execute(moves, on_done=lambda: self._done(sim))

    def _done(self, sim: Simulation) -> None:
        self.busy = False
        if self.restore_pending:
            self.restore_pending = False
            self._restore(sim)

    def _restore(self, sim: Simulation) -> None:
        moves = [
            DeviceMove(
                src="trainer", dst=None if src == "free" else src, devices=tuple(sorted(devs))
            )
            for src, devs in self.lent.items()
            if devs
        ]
        self.lent = {"rollout": set(), "inference": set(), "free": set()}
        if moves:
            self.busy = True
            sim.execute(moves, on_done=lambda: self._done(sim))
