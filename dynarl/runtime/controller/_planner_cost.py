"""PlannerCost: the scheduler's ``MigrationCost``, built on the migrate planner.

A P2P resize of a component with a known layout is costed by planning it:
``plan_reshard`` between its layout over ``old`` and over ``new`` canonical ranks gives
the bytes that must cross devices (the minimum), and seconds are a fixed overhead plus
bytes over a transfer rate. Other kinds cost their overhead (workload: abort and
re-dispatch; reboot: overhead plus writing and reading the state once). Rates and
overheads start from configured values and follow the measured migrations
(:meth:`observe`, an exponential average). Plans are cached per (component, old, new).
Pure apart from that cache and the measurements; runs in the scheduler's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from dynarl.migrate import Layout, plan_reshard
from dynarl.sched import CostEstimate, Resize
from dynarl.types import MigrationKind

__all__ = ["PlannerCost"]

logger = logging.getLogger(__name__)

LayoutOf = Callable[[tuple[int, ...]], Layout]

_DEFAULT_OVERHEAD_S = {
    MigrationKind.WORKLOAD: 1.0,
    MigrationKind.P2P: 1.0,
    MigrationKind.REBOOT: 5.0,
}


class PlannerCost:
    """Bytes from the reshard planner, seconds from a measured rate (module docstring)."""

    def __init__(
        self,
        layouts: Mapping[str, LayoutOf],
        *,
        bytes_per_s: float = 200e6,
        overhead_s: Mapping[MigrationKind, float] | None = None,
        smoothing: float = 0.5,
    ) -> None:
        if bytes_per_s <= 0 or not 0 < smoothing <= 1:
            raise ValueError("PlannerCost needs bytes_per_s > 0 and smoothing in (0, 1]")
        self._layouts = dict(layouts)
        self.bytes_per_s = bytes_per_s
        self.overhead_s = dict(_DEFAULT_OVERHEAD_S) | dict(overhead_s or {})
        self._smoothing = smoothing
        self._bytes: dict[tuple[str, int, int], int] = {}

    def resize_bytes(self, resize: Resize) -> int:
        """Bytes a P2P resize moves between devices (0 without a layout)."""
        layout = self._layouts.get(resize.component)
        old, new = resize.old_devices, resize.new_devices
        if layout is None or old == 0 or new == 0 or old == new:
            return 0
        key = (resize.component, old, new)
        if key not in self._bytes:
            try:
                src, dst = layout(tuple(range(old))), layout(tuple(range(new)))
                plan = plan_reshard(dst.tensor_map(), src.shards, dst.shards)
            except ValueError as exc:
                logger.info("no plan for %s %d -> %d: %s", resize.component, old, new, exc)
                self._bytes[key] = 0
            else:
                self._bytes[key] = plan.bytes_moved
        return self._bytes[key]

    def state_bytes(self, component: str, devices: int) -> int:
        """Bytes of the component's whole state over ``devices`` (0 without a layout)."""
        layout = self._layouts.get(component)
        if layout is None or devices == 0:
            return 0
        state = layout(tuple(range(devices)))
        return sum(t.nbytes for t in state.tensors)

    def estimate(self, resizes: tuple[Resize, ...]) -> CostEstimate:
        """Seconds of the slowest resize (they run concurrently); bytes summed."""
        seconds, moved = 0.0, 0
        for resize in resizes:
            if resize.new_devices == resize.old_devices:
                continue
            kind = resize.migration
            if kind is MigrationKind.P2P:
                nbytes = self.resize_bytes(resize)
            elif kind is MigrationKind.REBOOT:
                nbytes = 2 * self.state_bytes(resize.component, resize.old_devices)
            else:
                nbytes = 0
            moved += nbytes
            seconds = max(seconds, self.overhead_s[kind] + nbytes / self.bytes_per_s)
        return CostEstimate(seconds=seconds, bytes=moved)

    def observe(self, kind: MigrationKind, *, nbytes: int, seconds: float) -> None:
        """Fold a measured migration in: its rate (when it moved bytes) or its overhead."""
        if seconds <= 0:
            return
        a = self._smoothing
        if kind is MigrationKind.P2P and nbytes > 0:
            rate = nbytes / max(seconds - self.overhead_s[kind], seconds / 2)
            self.bytes_per_s = (1 - a) * self.bytes_per_s + a * rate
        else:
            self.overhead_s[kind] = (1 - a) * self.overhead_s[kind] + a * seconds
