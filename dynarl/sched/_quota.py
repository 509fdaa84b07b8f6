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

Devices that are already gone (``QuotaChange.lost``: their workers died) cannot be refused:
a component they leave below its minimum, or with no device at all, is refilled to its
smallest valid size, from the free devices first, then from the component that can best
spare them (the most devices above its own minimum; it keeps at least one and lands on a
valid size, giving up whole TP groups). Only a component whose unit is one device is
refilled (the devices it gets are not placed as node-local TP groups). Only when no
device can be found is such a change refused, and then the job cannot go on.
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
    size (for ``lost`` devices: and cannot be refilled, see the module docstring). Never
    raises for such input.
    """
    held = {d for _, devs in allocation.assignment for d in devs}
    granted = frozenset(change.granted) - quota
    # A lost device still held is gone, even if an earlier reclaim took it off the quota.
    reclaimed = frozenset(change.reclaimed) & (quota | held if change.lost else quota)
    size = len((quota | granted) - reclaimed)
    plan = QuotaPlan(granted=granted, reclaimed=reclaimed, num_devices=size)
    if size < config.min_quota_devices or (
        config.max_quota_devices and size > config.max_quota_devices
    ):
        reason = f"quota change to {size} devices refused: outside the job's elastic bounds"
        return replace(plan, refused=reason)
    free = (quota | granted) - held - reclaimed if change.lost else None
    moves, why = _reclaim_moves(
        reclaimed, allocation=allocation, nodes=nodes, config=config, free=free, total=size
    )
    if moves is None:
        return replace(plan, refused=f"reclaim refused: {why}")
    if not moves:
        return plan
    mapping = {name: set(devs) for name, devs in allocation.assignment}
    for move in moves:
        if move.src is not None:
            mapping[move.src] -= set(move.devices)
        if move.dst is not None:
            mapping[move.dst] |= set(move.devices)
    return replace(plan, moves=moves, new_allocation=Allocation.of(mapping))


def _reclaim_moves(
    reclaimed: Set[int],
    *,
    allocation: Allocation,
    nodes: Mapping[str, HyperNode],
    config: SchedulerConfig,
    free: Set[int] | None,
    total: int,
) -> tuple[tuple[DeviceMove, ...] | None, str]:
    """The shrink moves that give up ``reclaimed`` and, when the devices are lost
    (``free`` given: the devices no component holds), the moves that refill a component
    they leave short; ``(None, why)`` if one is impossible."""
    moves: list[DeviceMove] = []
    held = {name: sorted(devs) for name, devs in allocation.assignment}
    pool = sorted(free or ())
    short: dict[str, tuple[int, bool]] = {}
    for name, devices in allocation.assignment:
        lost = reclaimed & set(devices)
        if not lost:
            continue
        node = nodes[name]
        keep = sorted(set(devices) - lost)
        valid = [
            s for s in node.valid_sizes(0, len(keep), config.num_size_points) if s <= len(keep)
        ]
        # Refills place single devices, not node-local TP groups: a unit of 1 only.
        refill = free is not None and node.unit == 1
        target = _refill_size(node, len(keep), total, config) if refill else None
        if target is not None and (not valid or max(valid) == 0):
            moves.append(DeviceMove(src=name, dst=None, devices=tuple(sorted(lost))))
            held[name], short[name] = keep, (target - len(keep), bool(valid))
            continue
        if not valid:
            return None, f"{name} would fall below its minimum of {node.min_devices} devices"
        extra = release_devices(keep, len(keep) - max(valid), node.tp, config.num_devices_per_node)
        moves.append(DeviceMove(src=name, dst=None, devices=tuple(sorted(lost | set(extra)))))
        held[name] = sorted(set(keep) - set(extra))
        pool += extra
    for name, (need, may_empty) in short.items():
        given = _refill(
            name, need, held=held, pool=pool, short=set(short), nodes=nodes, config=config
        )
        if given is not None:
            moves += given
        elif may_empty:  # it may hold none: it gives up the rest and waits for a device
            if held[name]:
                moves.append(DeviceMove(src=name, dst=None, devices=tuple(held[name])))
                pool += held[name]
            held[name] = []
        else:
            why = f"{name} lost its devices and no component can spare the {need} it needs"
            return None, why
    return tuple(moves), ""


def _refill_size(node: HyperNode, have: int, total: int, config: SchedulerConfig) -> int | None:
    """The smallest valid size above ``have`` devices (None: there is none)."""
    sizes = node.valid_sizes(have + 1, node.upper_bound(total), config.num_size_points)
    return min((s for s in sizes if s > have), default=None)


def _refill(
    name: str,
    need: int,
    *,
    held: dict[str, list[int]],
    pool: list[int],
    short: Set[str],
    nodes: Mapping[str, HyperNode],
    config: SchedulerConfig,
) -> list[DeviceMove] | None:
    """Moves that give ``name`` ``need`` devices: free ones first, then from the others
    (``held`` and ``pool`` are updated when they are found); None if they cannot be."""
    moves = []
    taken, rest = pool[:need], pool[need:]
    if taken:
        moves.append(DeviceMove(src=None, dst=name, devices=tuple(taken)))
    missing = need - len(taken)

    def spare(donor: str) -> int:
        return len(held[donor]) - max(nodes[donor].min_devices, 1)

    for donor in sorted(
        (d for d in held if d != name and d not in short), key=lambda d: (-spare(d), d)
    ):
        if not missing:
            break
        node, have = nodes[donor], len(held[donor])
        sizes = [s for s in node.valid_sizes(1, have - 1, config.num_size_points) if s >= 1]
        fits = [s for s in sizes if have - s >= missing]
        if not fits:
            continue
        given = release_devices(held[donor], have - max(fits), node.tp, config.num_devices_per_node)
        moves.append(DeviceMove(src=donor, dst=name, devices=tuple(given[:missing])))
        if len(given) > missing:  # whole TP groups: what the refill does not need goes free
            moves.append(DeviceMove(src=donor, dst=None, devices=tuple(given[missing:])))
            rest += given[missing:]
        held[donor] = sorted(set(held[donor]) - set(given))
        missing = 0
    if missing:
        return None
    pool[:] = rest
    held[name] = sorted(set(held[name]) | {d for m in moves if m.dst == name for d in m.devices})
    return moves
