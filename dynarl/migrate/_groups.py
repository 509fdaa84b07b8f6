"""Process groups over exactly the ranks that need them, built without a world collective.

``torch.distributed.new_group`` must be called by every rank of the world (or relies on a
default-group store and a hashed name). A migration instead builds each group directly:
a ``PrefixStore`` named after the layout epoch and the group's ranks over the job's store,
a Gloo (CPU) or NCCL (GPU) backend constructed on it by the member ranks only, wrapped in a
``ProcessGroup`` and registered with torch.distributed so that the usual calls
(``batch_isend_irecv``, ``all_reduce``, ``get_rank(group)``, ``destroy_process_group``)
accept it. Non-members do nothing. The same code builds Gloo and NCCL groups.

Runs on every member rank, in its trainer thread (the calls block until all members have
joined, at most ``timeout``).

torch's collective flight recorder keeps a status entry for every process group a process
ever built and never drops it, and every layout epoch builds new groups: a job that
reshards every few seconds would grow without bound. :func:`build_group` therefore turns the
recorder off for its process (``TORCH_FR_BUFFER_SIZE=0``) unless that variable is set
already, before the first group is built; set it to record collectives for debugging, at
the cost of that growth (a few hundred bytes per group).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    Backend,
    PrefixStore,
    ProcessGroup,
    ProcessGroupGloo,
    Store,
    _register_process_group,
)
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import GroupName

from dynarl.migrate._layout import LayoutSpec

__all__ = ["CommGroup", "LayoutGroups", "build_group"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommGroup:
    """A torch process group together with the global ranks it spans."""

    name: str
    """Unique name, also the store prefix (``dynarl/<epoch>/<kind>/<ranks>``)."""
    ranks: tuple[int, ...]
    """Global ranks, in group-rank order."""
    pg: ProcessGroup = field(repr=False, compare=False)
    """The registered process group."""
    build_s: float = field(default=0.0, compare=False)
    """Seconds spent building it on this rank (rendezvous included)."""
    rendezvous_key: str = field(default="", compare=False)
    """This rank's Gloo rendezvous key in ``store`` (deleted on close; "" for none)."""
    store: Store | None = field(default=None, repr=False, compare=False)
    """The group's prefix of the job's store, where its ranks met."""

    def group_rank(self, rank: int) -> int:
        """Position of global ``rank`` in the group; ValueError if it is not a member."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in group {self.name}") from None

    def close(self) -> None:
        """Shut the backend down and unregister the group (idempotent)."""
        if self.pg in c10d._world.pg_map:
            dist.destroy_process_group(self.pg)
        # torch empties the group's tag list but keeps the key, and the store keeps every
        # rank's address: one each per name, and every layout epoch has new names (a job
        # that reshards for days would keep them all).
        tags = c10d._world.tags_to_pg
        if not tags.get(f"ptd:{self.name}", True):
            del tags[f"ptd:{self.name}"]
        if self.store is not None and self.rendezvous_key:
            try:
                self.store.delete_key(self.rendezvous_key)
            except (RuntimeError, dist.DistError) as err:  # the store is gone: nothing to free
                logger.debug("group %s: rendezvous key not deleted: %s", self.name, err)


def build_group(
    store: Store,
    *,
    name: str,
    ranks: Sequence[int],
    rank: int,
    backend: str = "gloo",
    timeout: timedelta = timedelta(seconds=30),
) -> CommGroup:
    """Build the group ``name`` over global ``ranks``; called by each member ``rank`` only
    (the first call in a process turns torch's flight recorder off, see the module).

    Raises ValueError when ``rank`` is not a member, the ranks repeat, or the backend is not
    ``"gloo"`` or ``"nccl"``; a member that does not join within ``timeout`` makes the
    others fail with the backend's timeout error.
    """
    ranks = tuple(ranks)
    if rank not in ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"group {name}: rank {rank} must be one of distinct ranks {ranks}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"group {name}: backend must be 'gloo' or 'nccl', got {backend!r}")
    _quiet_flight_recorder()
    start = time.perf_counter()
    prefix = PrefixStore(f"{name}/", store)
    group_rank, size = ranks.index(rank), len(ranks)
    pg = ProcessGroup(prefix, group_rank, size)
    device: torch.device
    impl: Backend
    if backend == "gloo":
        kind = ProcessGroup.BackendType.GLOO
        impl = ProcessGroupGloo(prefix, group_rank, size, timeout)
        device = torch.device("cpu")
    else:
        kind = ProcessGroup.BackendType.NCCL
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        impl = dist.ProcessGroupNCCL(prefix, group_rank, size, options)
        device = torch.device("cuda", torch.cuda.current_device())
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, impl)
    pg._set_group_name(GroupName(name))
    _register(pg, name=name, backend=backend, store=prefix, ranks=ranks)
    elapsed = time.perf_counter() - start
    logger.debug("built group %s (%s, %d ranks) in %.4f s", name, backend, size, elapsed)
    # Gloo's full-mesh rendezvous writes "<device index>/<group rank>" under the prefix.
    key = f"0/{group_rank}" if backend == "gloo" else ""
    return CommGroup(
        name=name, ranks=ranks, pg=pg, build_s=elapsed, rendezvous_key=key, store=prefix
    )


FLIGHT_RECORDER_VARIABLE = "TORCH_FR_BUFFER_SIZE"
"""What sizes torch's flight recorder (read once, when the process first records)."""


def _quiet_flight_recorder() -> None:
    """Turn torch's flight recorder off for this process unless the user sized it (see the
    module docstring); no effect once the recorder exists."""
    os.environ.setdefault(FLIGHT_RECORDER_VARIABLE, "0")


def _register(
    pg: ProcessGroup, *, name: str, backend: str, store: Store, ranks: tuple[int, ...]
) -> None:
    """Record the group in torch.distributed's registry, as ``new_group`` would."""
    world = c10d._world
    world.pg_map[pg] = (backend, store)
    world.pg_names[pg] = GroupName(name)
    world.pg_backend_config[pg] = backend
    world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    tag = f"ptd:{name}"
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.tags_to_pg.setdefault("", []).append(pg)
    world.pg_to_tag[pg] = tag
    _register_process_group(GroupName(name), pg)


@dataclass(kw_only=True, slots=True)
class LayoutGroups:
    """This rank's groups for one trainer layout and epoch (what Megatron needs).

    ``tp``, ``dp``, ``pp`` and ``mp`` are this rank's tensor-, data-, pipeline- and model-
    (tp × pp) parallel groups; ``embd`` joins the first and last stage of this rank's
    pipeline, ``pos_embd`` is its first stage, ``cp`` is its context-parallel group (this
    rank alone without CP). With CP, ``dp_cp`` and ``tp_cp`` join; with CP, expert
    parallelism or an expert TP of its own, so do the expert generator's ``ep``, ``etp``,
    ``edp``, ``tp_ep`` and ``tp_ep_pp`` (see :meth:`LayoutSpec.group_ranks`). Groups of
    size one are real groups too: Megatron calls collectives on them.
    """

    epoch: int
    """Layout epoch the groups belong to (part of every name)."""
    spec: LayoutSpec
    """The layout."""
    groups: dict[str, CommGroup]
    """``{kind: group}`` for kinds tp, dp, pp, mp, cp, embd, pos_embd and the optional
    dp_cp, tp_cp, ep, etp, edp, tp_ep, tp_ep_pp."""

    @classmethod
    def build(
        cls,
        store: Store,
        spec: LayoutSpec,
        *,
        rank: int,
        epoch: int,
        backend: str = "gloo",
        timeout: timedelta = timedelta(seconds=30),
    ) -> LayoutGroups:
        """Build this rank's groups of ``spec`` (a member rank only; others build nothing).

        Every member rank must call this with the same arguments. Raises ValueError when
        ``rank`` is not in the layout.
        """
        members = cls.member_ranks(spec, rank)
        groups = {}
        try:
            for kind, ranks in members.items():
                name = f"dynarl/{epoch}/{kind}/" + "-".join(map(str, ranks))
                groups[kind] = build_group(
                    store, name=name, ranks=ranks, rank=rank, backend=backend, timeout=timeout
                )
        except BaseException:
            for group in groups.values():
                group.close()
            raise
        return cls(epoch=epoch, spec=spec, groups=groups)

    @staticmethod
    def member_ranks(spec: LayoutSpec, rank: int) -> dict[str, tuple[int, ...]]:
        """The ranks of each group ``rank`` belongs to under ``spec`` (pure)."""
        spec.coords(rank)

        def mine(kind: str) -> tuple[int, ...]:
            (group,) = [g for g in spec.group_ranks(kind) if rank in g]
            return group

        out = {kind: mine(kind) for kind in ("tp", "dp", "pp", "mp")}
        pipeline = out["pp"]
        out["embd"] = tuple(dict.fromkeys((pipeline[0], pipeline[-1])))
        out["pos_embd"] = (pipeline[0],)
        out["cp"] = mine("cp")
        optional: tuple[str, ...] = ("dp_cp", "tp_cp") if spec.cp > 1 else ()
        if spec.cp > 1 or spec.ep > 1 or spec.etp != spec.tp:
            optional += ("ep", "etp", "edp", "tp_ep", "tp_ep_pp")
        out |= {kind: mine(kind) for kind in optional}
        if rank not in out["embd"]:
            del out["embd"]
        if rank not in out["pos_embd"]:
            del out["pos_embd"]
        return out

    @property
    def build_s(self) -> float:
        """Seconds this rank spent building all its groups."""
        return sum(g.build_s for g in self.groups.values())

    def close(self) -> None:
        """Destroy every group (idempotent)."""
        for group in self.groups.values():
            group.close()
