"""Which devices move: turning a chosen candidate's sizes into concrete device moves.

Device ``d`` sits on node ``d // devices_per_node``. Shrinking components release whole
tensor-parallel groups, from the nodes they hold fewest devices on first (ties: the
highest node), so whole nodes come free and the rest stays packed. Growing components,
largest TP size first, take node-local groups of their TP size from the free and
released devices, preferring nodes they already use, then the tightest fit, then the
lowest node. Every choice is deterministic. Runs in O(devices of the moving components)
with numpy; pure.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from dynarl.errors import SchedulingError
from dynarl.sched.decision import DeviceMove
from dynarl.sched.graph import HyperNode
from dynarl.types import Allocation

__all__ = ["place", "release_devices"]

IntArray = npt.NDArray[np.int64]


def place(
    allocation: Allocation,
    free: Sequence[int],
    sizes: Mapping[str, int],
    nodes: Mapping[str, HyperNode],
    devices_per_node: int,
) -> tuple[DeviceMove, ...]:
    """Device moves that take ``allocation`` (plus ``free`` devices) to ``sizes``.

    Raises SchedulingError when a growing component cannot get its TP groups inside
    single nodes, or when a size change is not a whole number of TP groups; ValueError
    when there are not enough devices.
    """
    per_node = devices_per_node
    pool_devices: list[IntArray] = [np.asarray(sorted(free), dtype=np.int64)]
    pool_sources: list[str | None] = [None]
    growers: list[tuple[str, int]] = []
    widest = max((nodes[n].tp for n in sizes if sizes[n] > allocation.count(n)), default=1)
    for name in sorted(sizes):
        held = np.asarray(allocation.devices(name), dtype=np.int64)
        change = sizes[name] - held.shape[0]
        tp = nodes[name].tp
        if change % tp:
            raise SchedulingError(
                f"{name}: a change of {change} devices is not whole TP groups of {tp}"
            )
        if change < 0:
            block = math.lcm(tp, widest) if math.lcm(tp, widest) <= per_node else tp
            pool_devices.append(_release(held, -change, tp, per_node, block))
            pool_sources.append(name)
        elif change > 0:
            growers.append((name, change))
    devices = np.concatenate(pool_devices)
    sources = np.concatenate([np.full(d.shape[0], i) for i, d in enumerate(pool_devices)])
    if sum(change for _, change in growers) > devices.shape[0]:
        raise ValueError("the new sizes need more devices than are free or released")
    order = np.argsort(devices, kind="stable")
    devices, sources = devices[order], sources[order]
    taken = np.zeros(devices.shape[0], dtype=bool)
    moves: dict[tuple[str | None, str | None], list[int]] = defaultdict(list)
    growers.sort(key=lambda g: (-nodes[g[0]].tp, g[0]))
    for name, change in growers:
        picked = _take(devices, taken, change, nodes[name].tp, per_node, allocation.devices(name))
        if picked is None:
            raise SchedulingError(
                f"{name} needs {change // nodes[name].tp} TP groups of {nodes[name].tp} devices "
                f"inside single nodes; the free and released devices do not have them"
            )
        taken[picked] = True
        for index in picked.tolist():
            moves[(pool_sources[int(sources[index])], name)].append(int(devices[index]))
    for index in np.flatnonzero(~taken).tolist():
        src = pool_sources[int(sources[index])]
        if src is not None:
            moves[(src, None)].append(int(devices[index]))
    return tuple(
        DeviceMove(src=src, dst=dst, devices=tuple(sorted(devs)))
        for (src, dst), devs in sorted(moves.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1])))
    )


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


def _take(
    devices: IntArray,
    taken: npt.NDArray[np.bool_],
    count: int,
    tp: int,
    per_node: int,
    already: Sequence[int],
) -> IntArray | None:
    """Indices into ``devices`` of ``count // tp`` node-local groups of ``tp``, or None."""
    free_idx = np.flatnonzero(~taken)
    node = devices[free_idx] // per_node
    nodes, starts, counts = np.unique(node, return_index=True, return_counts=True)
    mine = set((np.asarray(already, dtype=np.int64) // per_node).tolist())
    rows = zip(nodes.tolist(), counts.tolist(), starts.tolist(), strict=True)
    ranking = sorted((n not in mine, c, n, s) for n, c, s in rows if c >= tp)
    groups = count // tp
    picked: list[IntArray] = []
    for _, c, _, s in ranking:
        if groups == 0:
            break
        g = min(c // tp, groups)
        picked.append(free_idx[s : s + g * tp])
        groups -= g
    if groups:
        return None
    return np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
