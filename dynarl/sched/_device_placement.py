"""Which devices move: turning a chosen candidate's sizes into concrete device moves.

Device ``d`` sits on node ``d // devices_per_node``. Shrinking components release whole
tensor-parallel groups, from the nodes they hold fewest devices on first (ties: the
highest node), so whole nodes come free and the rest stays packed. A shrinking component
whose registered workers are its TP groups (``HyperNode.workers``, one node each) gives up
its least-utilized workers instead: a workload migration re-does the in-flight work of
the workers it releases elsewhere (rollout: utilization is active KV / capacity, exactly
the KV the moved requests re-prefill), so the least loaded cost least; topology only
breaks ties. Growing components,
largest TP size first, take node-local groups of their TP size from the free and
released devices, preferring nodes they already use, then the tightest fit, then the
lowest node. Every choice is deterministic. Runs in O(devices of the moving components)
with numpy; pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from dynarl.errors import SchedulingError
from dynarl.sched._decision import DeviceMove
from dynarl.sched._graph import HyperNode
from dynarl.types import Allocation

__all__ = ["place", "release_devices"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def place(
    allocation: Allocation,
    free: Sequence[int],
    sizes: Mapping[str, int],
    nodes: Mapping[str, HyperNode],
    devices_per_node: int,
    *,
    load: Mapping[str, Sequence[float]] | None = None,
) -> tuple[DeviceMove, ...]:
    """Device moves that take ``allocation`` (plus ``free`` devices) to ``sizes``.

    ``load`` gives, per component, the utilization of each registered worker in worker
    order (a report's ``utilization``); without it the workers' own ``utilization`` is used.

    Raises SchedulingError when a growing component cannot get its TP groups inside
    single nodes, or when a size change is not a whole number of TP groups; ValueError
    when there are not enough devices.
    """
    per_node = devices_per_node
    changes = {name: sizes[name] - allocation.count(name) for name in sorted(sizes)}
    for name, change in changes.items():
        if change % nodes[name].tp:
            raise SchedulingError(
                f"{name}: a change of {change} devices is not whole TP groups of {nodes[name].tp}"
            )
    widest = max((nodes[n].tp for n, c in changes.items() if c > 0), default=1)
    pools: list[IntArray] = [np.asarray(sorted(free), dtype=np.int64)]
    sources: list[str | None] = [None]
    for name, change in changes.items():
        if change < 0:
            tp = nodes[name].tp
            block = math.lcm(tp, widest) if math.lcm(tp, widest) <= per_node else tp
            devs = allocation.devices(name)
            loads = (load or {}).get(name)
            groups = _worker_groups(nodes[name], devs, per_node, loads)
            if groups is not None:
                pools.append(_release_workers(groups, -change, tp, per_node, block))
            else:
                held = np.fromiter(devs, dtype=np.int64, count=len(devs))
                pools.append(_release(held, -change, tp, per_node, block))
            sources.append(name)
    devices = np.concatenate(pools)
    codes = np.concatenate([np.full(p.shape[0], i) for i, p in enumerate(pools)])
    if devices.shape[0] > 1 and bool(np.any(devices[1:] < devices[:-1])):
        order = np.argsort(devices, kind="stable")
        devices, codes = devices[order], codes[order]
    growers = sorted(
        ((n, c) for n, c in changes.items() if c > 0), key=lambda g: (-nodes[g[0]].tp, g[0])
    )
    if sum(c for _, c in growers) > devices.shape[0]:
        raise ValueError("the new sizes need more devices than are free or released")
    taken = np.zeros(devices.shape[0], dtype=bool)
    moves: list[DeviceMove] = []
    for name, change in growers:
        tp = nodes[name].tp
        devs = allocation.devices(name)
        already = np.fromiter(devs, dtype=np.int64, count=len(devs))
        picked = _take(devices, taken, change, tp, per_node, already)
        if picked is None:
            raise SchedulingError(
                f"{name} needs {change // tp} TP groups of {tp} devices inside single "
                "nodes; the free and released devices do not have them"
            )
        picked.sort()
        taken[picked] = True
        moves += _grouped(devices[picked], codes[picked], sources, name)
    left = np.flatnonzero(~taken)
    moves += [m for m in _grouped(devices[left], codes[left], sources, None) if m.src is not None]
    return tuple(sorted(moves, key=lambda m: (str(m.src), str(m.dst))))


def _grouped(
    devices: IntArray, codes: IntArray, sources: list[str | None], dst: str | None
) -> list[DeviceMove]:
    """One move per source of ``devices`` (ascending) towards ``dst``."""
    present = np.flatnonzero(np.bincount(codes, minlength=len(sources)))
    if present.shape[0] == 1:
        return [DeviceMove(src=sources[int(present[0])], dst=dst, devices=tuple(devices.tolist()))]
    return [
        DeviceMove(src=sources[int(code)], dst=dst, devices=tuple(devices[codes == code].tolist()))
        for code in present
    ]


def release_devices(devices: Sequence[int], count: int, tp: int, per_node: int) -> list[int]:
    """``count`` of ``devices`` to give up: whole TP groups, sparsest nodes first."""
    if count <= 0:
        return []
    held = np.asarray(devices, dtype=np.int64)
    return sorted(_release(held, count, tp, per_node, tp).tolist())


def _release(held: IntArray, count: int, tp: int, per_node: int, block: int) -> IntArray:
    """``count`` devices of ``held``, sparsest nodes first.

    First whole ``block`` s (lcm of this TP and the largest receiving TP) inside single
    nodes, so a receiver can rebuild its groups from them; then whole TP groups for the
    rest.
    """
    if held.shape[0] > 1 and bool(np.any(held[1:] < held[:-1])):
        held = np.sort(held)
    node = held // per_node
    starts = np.r_[0, np.flatnonzero(np.diff(node)) + 1]
    lengths = np.diff(np.r_[starts, held.shape[0]])
    first_node = node[starts]
    rank = np.arange(held.shape[0]) - np.repeat(starts, lengths)
    # Sparsest node first, ties to the highest node.
    node_order = np.lexsort((-first_node, lengths))
    blocks = lengths[node_order] // block
    wanted = count // block
    before = np.cumsum(blocks) - blocks
    took = np.clip(wanted - before, 0, blocks)
    per_node_take = np.zeros(lengths.shape[0], dtype=np.int64)
    per_node_take[node_order] = took * block
    chosen = rank >= np.repeat(lengths - per_node_take, lengths)
    rest = count - int(chosen.sum())
    if rest:
        chunk = rank // tp
        node_count = np.repeat(lengths, lengths)
        order = np.lexsort((-rank, -chunk, -node, node_count))
        order = order[~chosen[order]]
        chosen[order[:rest]] = True
    released: IntArray = held[chosen]
    return released


def _worker_groups(
    node: HyperNode, devices: Sequence[int], per_node: int, loads: Sequence[float] | None
) -> tuple[IntArray, FloatArray] | None:
    """The component's workers as (devices: workers × tp, load), or None when not usable.

    Usable: the registered workers are exactly the component's TP groups (``tp`` devices
    each, inside one node, no pipeline stages) and cover exactly the devices it holds.
    The load is ``loads[i]`` for the ``i``-th worker when ``loads`` has one per worker,
    else the worker's own utilization.
    """
    workers = node.workers
    if not workers or node.pp != 1 or len(workers) * node.tp != len(devices):
        return None
    if any(len(w.devices) != node.tp for w in workers):
        return None
    devs = np.sort(np.array([w.devices for w in workers], dtype=np.int64), axis=1)
    if not np.array_equal(np.sort(devs, axis=None), np.sort(np.asarray(devices, np.int64))):
        return None
    if bool(np.any(devs[:, 0] // per_node != devs[:, -1] // per_node)):
        return None
    if loads is None or len(loads) != len(workers):
        loads = [w.utilization for w in workers]
    return devs, np.asarray(loads, dtype=np.float64)


def _release_workers(
    groups: tuple[IntArray, FloatArray], count: int, tp: int, per_node: int, block: int
) -> IntArray:
    """``count`` devices of whole workers, the least utilized first.

    First whole ``block`` s inside single nodes (a node's lightest workers together; the
    cheapest blocks across nodes win, ties to the node holding fewest devices, then the
    highest node), then single workers, least utilized first, for the rest. O(workers
    log workers) with numpy.
    """
    devs, load = groups
    node = devs[:, 0] // per_node
    # Workers by node, lightest first inside each node (ties: the higher devices).
    order = np.lexsort((-devs[:, 0], load, node))
    node_o, load_o = node[order], load[order]
    starts = np.r_[0, np.flatnonzero(np.diff(node_o)) + 1]
    lengths = np.diff(np.r_[starts, node_o.shape[0]])
    rank = np.arange(node_o.shape[0]) - np.repeat(starts, lengths)
    held = np.repeat(lengths, lengths) * tp
    per_block = max(block // tp, 1)
    chunk = rank // per_block
    full = (chunk + 1) * per_block <= np.repeat(lengths, lengths)
    # One key per (node, chunk): its cost is the chunk's total load.
    key = np.repeat(starts, lengths) + chunk
    cost = np.bincount(key, weights=load_o, minlength=node_o.shape[0])
    firsts = np.flatnonzero(full & (rank % per_block == 0))
    ranked = firsts[np.lexsort((-node_o[firsts], held[firsts], chunk[firsts], cost[key[firsts]]))]
    picked_keys = key[ranked[: count // block]]
    chosen = np.isin(key, picked_keys) & full
    rest = (count - int(chosen.sum()) * tp) // tp
    if rest > 0:
        left = np.flatnonzero(~chosen)
        first_dev = devs[order, 0]
        singles = left[np.lexsort((-first_dev[left], -node_o[left], held[left], load_o[left]))][
            :rest
        ]
        chosen[singles] = True
    released: IntArray = np.sort(devs[order][chosen].ravel())
    return released


def _take(
    devices: IntArray,
    taken: npt.NDArray[np.bool_],
    count: int,
    tp: int,
    per_node: int,
    already: IntArray,
) -> IntArray | None:
    """Indices into ``devices`` of ``count // tp`` node-local groups of ``tp``, or None.

    Nodes the component already uses come first, then the tightest fit, then the lowest.
    """
    free_idx = np.flatnonzero(~taken)
    node = devices[free_idx] // per_node  # ascending: ``devices`` is sorted
    starts = np.r_[0, np.flatnonzero(np.diff(node)) + 1] if node.shape[0] else node[:0]
    node_ids = node[starts]
    counts = np.diff(np.r_[starts, node.shape[0]])
    mine = already // per_node  # ascending: allocations keep devices sorted
    mine = mine[np.r_[True, mine[1:] != mine[:-1]]] if mine.shape[0] else mine
    slot = np.minimum(np.searchsorted(mine, node_ids), max(mine.shape[0] - 1, 0))
    foreign = ~(mine[slot] == node_ids) if mine.shape[0] else np.ones(node_ids.shape[0], bool)
    groups = counts // tp
    order = np.lexsort((node_ids, counts, foreign))
    order = order[groups[order] > 0]
    available = groups[order]
    wanted = count // tp
    take = np.clip(wanted - (np.cumsum(available) - available), 0, available)
    if int(take.sum()) < wanted:
        return None
    chosen = take > 0
    lengths = take[chosen] * tp
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    picked: IntArray = free_idx[np.repeat(starts[order][chosen], lengths) + offsets]
    return picked
