"""Shard files: a sharded state written by one layout, read back by any other.

What a :class:`~dynarl.runtime.worker.Reshardable` role needs for the reboot migration:
:func:`save_shards` writes one rank's shards (their global boxes and data) to
``<directory>/shards-<rank>.pt`` (written aside, then renamed: a reader never sees half a
file); :func:`load_shards` fills the shards of a new layout from every such file, with
the copies :func:`~dynarl.migrate.plan_reshard` plans from the saved shards to the new
ones, so nothing is read twice and every destination element is written exactly once.
Blocking; runs on a worker's compute thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from dynarl.migrate import Region, Shard, TensorSpec, plan_reshard

__all__ = ["load_shards", "save_shards"]

_PREFIX = "shards-"


def save_shards(
    directory: str | os.PathLike[str], rank: int, views: Mapping[Shard, torch.Tensor]
) -> Path:
    """Write ``rank``'s shards under ``directory``; returns the file written."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    payload = [
        (shard.tensor, list(shard.region.offsets), list(shard.region.sizes), view.detach().clone())
        for shard, view in views.items()
    ]
    final = folder / f"{_PREFIX}{rank}.pt"
    partial = final.with_suffix(".partial")
    torch.save(payload, partial)
    os.replace(partial, final)
    return final


def load_shards(
    directory: str | os.PathLike[str],
    views: Mapping[Shard, torch.Tensor],
    tensors: Mapping[str, TensorSpec],
) -> int:
    """Fill ``views`` (this rank's shards of the new layout) from the shard files in
    ``directory``; returns the elements copied.

    Raises ValueError when the files do not cover every destination element.
    """
    saved: dict[Shard, torch.Tensor] = {}
    for path in sorted(Path(directory).glob(f"{_PREFIX}*.pt")):
        rank = int(path.stem.removeprefix(_PREFIX))
        for name, offsets, sizes, data in torch.load(path, weights_only=True):
            region = Region(offsets=tuple(offsets), sizes=tuple(sizes))
            saved[Shard(tensor=name, rank=rank, region=region)] = data
    if not views:
        return 0
    sources = tuple(shard for shard in saved if shard.tensor in tensors)
    plan = plan_reshard(tensors, sources, tuple(views))
    by_tensor: dict[tuple[str, int], list[Shard]] = {}
    for shard in saved:
        by_tensor.setdefault((shard.tensor, shard.rank), []).append(shard)
    targets: dict[str, list[Shard]] = {}
    for shard in views:
        targets.setdefault(shard.tensor, []).append(shard)
    copied = 0
    for item in plan.items:
        source = _holder(by_tensor.get((item.tensor, item.src_rank), []), item.region)
        target = _holder(targets.get(item.tensor, []), item.region)
        _view(views[target], target.region, item.region).copy_(
            _view(saved[source], source.region, item.region)
        )
        copied += item.region.numel
    return copied


def _holder(shards: list[Shard], region: Region) -> Shard:
    for shard in shards:
        if shard.region.contains(region):
            return shard
    raise ValueError(f"no shard holds {region}")


def _view(tensor: torch.Tensor, outer: Region, region: Region) -> torch.Tensor:
    """``region`` (global coordinates) of ``tensor``, which holds ``outer``."""
    return tensor[region.relative_to(outer).slices() or ...]
