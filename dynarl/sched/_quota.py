"""A cluster quota change as a pure plan: what joins, what leaves, which moves it forces.

The cluster may grant the job devices or take some back
(:class:`~dynarl.sched._events.QuotaChange`).
:func:`plan_quota_change` works out, without touching any state, whether the change is
acceptable (the new quota within the job's elastic bounds, every component that loses
devices still at a valid size) and, if so, the forced shrink moves a reclaim needs: each
component that holds a reclaimed device gives it up, plus whatever more it must release
(whole TP groups, see :func:`~dynarl.sched._device_placement.release_devices`) to land on a valid
size. The scheduler adopts the plan (see :class:`~dynarl.sched.Scheduler`). Runs
in the scheduler's loop or the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, replace

from dynarl.sched._decision import DeviceMove
from dynarl.sched._device_placement import release_devices
from dynarl.sched._events import QuotaChange
from dynarl.sched._graph import HyperNode
from dynarl.sched._sched_config import SchedulerConfig
from dynarl.types import Allocation

__all__ = ["QuotaPlan", "plan_quota_change"]


@dataclass(frozen=True, kw_only=True, slots=True)
class QuotaPlan:
    """What a quota change does to the job's devices."""

    granted: frozenset[int]
    """Devices new to the quota (already held grants are ignored)."""
    reclaimed: frozenset[int]
    """Devices of the quota the cluster takes back (unknown ones are ignored)."""
    num_devices: int
    """Size of the quota once the change is in force."""
    refused: str = ""
    """Why the change is refused; empty when it is accepted."""
    moves: tuple[DeviceMove, ...] = ()
    """Forced shrink moves (``dst`` None), one per component that loses devices."""
    new_allocation: Allocation | None = None
    """The allocation after ``moves``; None when there are none."""


def plan_quota_change(
    change: QuotaChange,
    *,
    quota: Set[int],
    allocation: Allocation,
    nodes: Mapping[str, HyperNode],
    config: SchedulerConfig,
) -> QuotaPlan:
    """Plan ``change`` against the job's ``quota`` and the ``allocation`` in force.

    Refused (``refused`` says why, nothing moves) when the new quota falls outside
    ``[min_quota_devices, max_quota_devices]`` or a component would fall below its minimum
    size. Never raises for such input.
    """
    granted = frozenset(change.granted) - quota
    reclaimed = frozenset(change.reclaimed) & quota
    size = len(quota) + len(granted) - len(reclaimed)
    plan = QuotaPlan(granted=granted, reclaimed=reclaimed, num_devices=size)
    if size < config.min_quota_devices or (
        config.max_quota_devices and size > config.max_quota_devices
    ):
        reason = f"quota change to {size} devices refused: outside the job's elastic bounds"
        return replace(plan, refused=reason)
    moves, why = _reclaim_moves(reclaimed, allocation=allocation, nodes=nodes, config=config)
    if moves is None:
        return replace(plan, refused=f"reclaim refused: {why}")
    if not moves:
        return plan
    mapping = {name: set(devs) for name, devs in allocation.assignment}
    for move in moves:
        assert move.src is not None
        mapping[move.src] -= set(move.devices)
    return replace(plan, moves=moves, new_allocation=Allocation.of(mapping))


def _reclaim_moves(
    reclaimed: Set[int],
    *,
    allocation: Allocation,
    nodes: Mapping[str, HyperNode],
    config: SchedulerConfig,
) -> tuple[tuple[DeviceMove, ...] | None, str]:
    """The shrink moves that give up ``reclaimed``; ``(None, why)`` if one is impossible."""
    moves = []
    for name, devices in allocation.assignment:
        lost = reclaimed & set(devices)
        if not lost:
            continue
        node = nodes[name]
        keep = sorted(set(devices) - lost)
        valid = [
            s for s in node.valid_sizes(0, len(keep), config.num_size_points) if s <= len(keep)
        ]
        if not valid:
            return None, f"{name} would fall below its minimum of {node.min_devices} devices"
        extra = release_devices(keep, len(keep) - max(valid), node.tp, config.num_devices_per_node)
        moves.append(DeviceMove(src=name, dst=None, devices=tuple(sorted(lost | set(extra)))))
    return tuple(moves), ""
