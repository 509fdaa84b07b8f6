"""Checkpoints that bind model version, trainer and optimizer state, RNG states and the
sample cursor; written atomically, verified on load, restorable into another layout.

**On disk.** One directory per save, ``<root>/step-<steps_done:08d>-<token>/``::

    shard-<rank:05d>.bin   the rank's tensors, raw bytes, each at a 64-byte aligned offset
    MANIFEST.json          written last: what the checkpoint is (:class:`CheckpointManifest`)

Each file is written under a temporary name, fsynced, renamed, and the directory fsynced;
the manifest goes last, so a checkpoint exists exactly when its manifest does. The
manifest lists every tensor (dtype, shape, offset, CRC-32), each rank's RNG states
(:class:`~dynarl.runtime.durable.RngState`), the ``dynarl.migrate`` layout the tensors were
saved in, the model version, the steps done and the sample cursor. Loading checks the
manifest's SHA-256 (recorded in the journal) and every tensor's CRC-32
(:class:`~dynarl.errors.IntegrityError`). Tensors are never pickled.

**Who calls what.** A single process calls :meth:`CheckpointStore.save`. A sharded save
is the controller's :meth:`~CheckpointStore.begin`, each rank's
:meth:`~CheckpointStore.write_shard` (returning a small :class:`ShardRecord` that travels
to the controller on the bus) and the controller's :meth:`~CheckpointStore.publish`, which
also keeps the last ``num_keep`` checkpoints. :meth:`~CheckpointStore.restore` gives one
rank its local tensors in any layout of the same tensors, through ``plan_reshard``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from dynarl.errors import IntegrityError
from dynarl.migrate import Layout, Placement, Transfer, plan_reshard
from dynarl.runtime.durable._journal_records import CheckpointSaved
from dynarl.runtime.durable._rng import RngState
from dynarl.runtime.durable._shard import (
    ShardRecord,
    fsync_dir,
    read_tensors,
    torch_dtype,
    write_atomic,
    write_shard_file,
)

__all__ = ["CheckpointManifest", "CheckpointRef", "CheckpointStore"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
MetaValue = str | int | float | bool


class CheckpointManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a published checkpoint holds (``MANIFEST.json``)."""

    format: int
    """Checkpoint format version."""
    steps_done: int
    """Training steps completed."""
    version: int
    """Model (weights) version."""
    cursor: int
    """Sample cursor to resume from."""
    time: float
    """Wall-clock time of publication, seconds."""
    shards: tuple[ShardRecord, ...]
    """Every rank's shard."""
    layout: Layout | None = None
    """Layout the shards were saved in (None: unsharded, restore with ``read_shard``)."""
    metadata: dict[str, MetaValue] = {}
    """Free-form scalars (optimizer hyper-parameters, trainer config...)."""

    def shard(self, rank: int) -> ShardRecord:
        """The shard of ``rank``; ValueError if the checkpoint has none."""
        for shard in self.shards:
            if shard.rank == rank:
                return shard
        raise ValueError(f"the checkpoint has no shard of rank {rank}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointRef:
    """A published checkpoint, as the journal records it."""

    path: str
    """Its directory."""
    steps_done: int
    """Training steps completed."""
    version: int
    """Model version."""
    cursor: int
    """Sample cursor."""
    digest: str
    """SHA-256 of its manifest."""

    @classmethod
    def from_record(cls, record: CheckpointSaved) -> CheckpointRef:
        """The reference a journal record holds."""
        return cls(
            path=record.path,
            steps_done=record.steps_done,
            version=record.version,
            cursor=record.cursor,
            digest=record.digest,
        )


class CheckpointStore:
    """The checkpoints under ``root`` (created if missing); keeps the last ``num_keep``.

    Keep ``num_keep >= 2``: the journal may still point at the previous checkpoint when a
    crash falls between publishing a new one and journaling it. Raises ValueError for
    ``num_keep < 1``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        num_keep: int = 3,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if num_keep < 1:
            raise ValueError(f"num_keep must be >= 1, got {num_keep}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.num_keep = num_keep
        self._clock = clock

    # ------------------------------------------------------------------ writing

    def begin(self, steps_done: int) -> Path:
        """A fresh directory for one save (controller); pass it to every writing rank."""
        directory = self.root / f"step-{steps_done:08d}-{secrets.token_hex(4)}"
        directory.mkdir()
        fsync_dir(self.root)
        return directory

    def write_shard(
        self,
        directory: Path,
        rank: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        rng: RngState | None = None,
    ) -> ShardRecord:
        """Write ``rank``'s tensors (on that rank) durably; returns their record."""
        return write_shard_file(directory / f"shard-{rank:05d}.bin", rank, tensors, rng=rng)

    def publish(
        self,
        directory: Path,
        *,
        steps_done: int,
        version: int,
        cursor: int,
        shards: Sequence[ShardRecord],
        layout: Layout | None = None,
        metadata: Mapping[str, MetaValue] | None = None,
    ) -> CheckpointRef:
        """Write the manifest (the commit point), then drop old checkpoints (controller).

        Raises ValueError if a shard file is missing or of the wrong size, or if two
        shards claim one rank.
        """
        ranks = [s.rank for s in shards]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"two shards claim one rank: {sorted(ranks)}")
        for shard in shards:
            size = (directory / shard.file).stat().st_size
            if size != shard.nbytes:
                raise ValueError(f"{shard.file} holds {size} bytes, its record {shard.nbytes}")
        manifest = CheckpointManifest(
            format=FORMAT_VERSION, steps_done=steps_done, version=version, cursor=cursor,
            time=self._clock(), shards=tuple(sorted(shards, key=lambda s: s.rank)),
            layout=layout, metadata=dict(metadata or {}),
        )  # fmt: skip
        data = msgspec.json.encode(manifest)
        write_atomic(directory / MANIFEST, [data])
        ref = CheckpointRef(
            path=str(directory), steps_done=steps_done, version=version, cursor=cursor,
            digest=hashlib.sha256(data).hexdigest(),
        )  # fmt: skip
        logger.info("published checkpoint %s (%d steps, v%d)", directory, steps_done, version)
        self.prune()
        return ref

    def save(
        self,
        *,
        steps_done: int,
        version: int,
        cursor: int,
        shards: Mapping[int, Mapping[str, torch.Tensor]],
        rng: Mapping[int, RngState] | None = None,
        layout: Layout | None = None,
        metadata: Mapping[str, MetaValue] | None = None,
    ) -> CheckpointRef:
        """Begin, write every rank's shard and publish, in this process."""
        directory = self.begin(steps_done)
        records = [
            self.write_shard(directory, rank, tensors, rng=(rng or {}).get(rank))
            for rank, tensors in shards.items()
        ]
        return self.publish(
            directory, steps_done=steps_done, version=version, cursor=cursor, shards=records,
            layout=layout, metadata=metadata,
        )  # fmt: skip

    # ------------------------------------------------------------------ reading

    def checkpoints(self) -> list[CheckpointRef]:
        """Published checkpoints whose manifest decodes, oldest first."""
        found: list[tuple[float, CheckpointRef]] = []
        for directory in self.root.glob("step-*"):
            try:
                data = (directory / MANIFEST).read_bytes()
                manifest = msgspec.json.decode(data, type=CheckpointManifest)
            except (OSError, msgspec.DecodeError):
                continue
            ref = CheckpointRef(
                path=str(directory), steps_done=manifest.steps_done, version=manifest.version,
                cursor=manifest.cursor, digest=hashlib.sha256(data).hexdigest(),
            )  # fmt: skip
            found.append((manifest.time, ref))
        found.sort(key=lambda pair: (pair[1].steps_done, pair[0]))
        return [ref for _, ref in found]

    def latest(self) -> CheckpointRef | None:
        """The newest published checkpoint, if any."""
        refs = self.checkpoints()
        return refs[-1] if refs else None

    def manifest(self, ref: CheckpointRef) -> CheckpointManifest:
        """The manifest of ``ref``. Raises IntegrityError if it is missing, does not match
        ``ref.digest`` or does not decode."""
        try:
            data = (Path(ref.path) / MANIFEST).read_bytes()
        except OSError as err:
            raise IntegrityError(f"checkpoint {ref.path} has no readable manifest") from err
        if hashlib.sha256(data).hexdigest() != ref.digest:
            raise IntegrityError(f"checkpoint {ref.path}: manifest does not match its digest")
        try:
            manifest = msgspec.json.decode(data, type=CheckpointManifest)
        except msgspec.DecodeError as err:
            raise IntegrityError(f"checkpoint {ref.path}: bad manifest: {err}") from None
        if manifest.format != FORMAT_VERSION:
            raise IntegrityError(f"checkpoint {ref.path}: format {manifest.format}")
        return manifest

    def read_shard(
        self, ref: CheckpointRef, rank: int, names: Iterable[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """``rank``'s saved tensors (or only ``names``), each verified against its CRC-32.

        Raises IntegrityError on a checksum mismatch or a short file, ValueError for a
        rank or name the checkpoint does not hold.
        """
        shard = self.manifest(ref).shard(rank)
        return read_tensors(Path(ref.path) / shard.file, shard, names)

    def restore(self, ref: CheckpointRef, layout: Layout, rank: int) -> dict[str, torch.Tensor]:
        """``rank``'s local tensors under ``layout``, cut from the saved layout's shards.

        Raises ValueError if the checkpoint has no layout or its tensors differ from
        ``layout``'s (names, shapes, dtypes); IntegrityError as :meth:`read_shard`.
        """
        manifest = self.manifest(ref)
        saved = manifest.layout
        if saved is None:
            raise ValueError(f"checkpoint {ref.path} has no layout; use read_shard")
        specs = saved.tensor_map()
        for name, spec in layout.tensor_map().items():
            if specs.get(name) != spec:
                raise ValueError(f"tensor {name!r} differs from the checkpoint's {specs.get(name)}")
        plan = plan_reshard(specs, saved.shards, [p.shard for p in layout.placements_on(rank)])
        out = {
            name: torch.zeros(shape, dtype=torch_dtype(specs[name].dtype))
            for name, shape in layout.local_shapes_on(rank).items()
        }
        loaded: dict[tuple[int, str], torch.Tensor] = {}
        for item in plan.items:
            key = (item.src_rank, item.tensor)
            if key not in loaded:
                shard = manifest.shard(item.src_rank)
                path = Path(ref.path) / shard.file
                loaded[key] = read_tensors(path, shard, [item.tensor])[item.tensor]
            source = _view(saved.placements_on(item.src_rank), item, loaded[key])
            _view(layout.placements_on(rank), item, out[item.tensor]).copy_(source)
        return out

    # ------------------------------------------------------------------ retention

    def prune(self) -> list[Path]:
        """Remove all but the newest ``num_keep`` checkpoints, and unpublished directories
        not newer than the newest one (abandoned saves); returns what was removed."""
        refs = self.checkpoints()
        keep = {Path(r.path) for r in refs[-self.num_keep :]}
        newest = refs[-1].steps_done if refs else -1
        removed: list[Path] = []
        for directory in self.root.glob("step-*"):
            if directory in keep:
                continue
            published = (directory / MANIFEST).exists()
            if not published and _step_of(directory) > newest:
                continue  # maybe a save in progress
            if published:
                (directory / MANIFEST).unlink()  # unpublish first: never half a checkpoint
                fsync_dir(directory)
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
        if removed:
            logger.info("removed %d old checkpoints under %s", len(removed), self.root)
        return removed


def _step_of(directory: Path) -> int:
    try:
        return int(directory.name.split("-")[1])
    except (IndexError, ValueError):
        return -1


def _view(placements: Sequence[Placement], item: Transfer, local: torch.Tensor) -> torch.Tensor:
    """The elements of ``item.region`` inside ``local``, through the placement holding them."""
    region = item.region
    for placement in placements:
        shard = placement.shard
        if shard.tensor != item.tensor:
            continue
        box = shard.region
        inside = all(
            b <= o and o + s <= b + n
            for o, s, b, n in zip(region.offsets, region.sizes, box.offsets, box.sizes, strict=True)
        )
        if inside:
            relative = tuple(
                slice(o - b, o - b + s)
                for o, s, b in zip(region.offsets, region.sizes, box.offsets, strict=True)
            )
            view: torch.Tensor = placement.view(local)
            return view[relative] if relative else view
    raise AssertionError(f"no placement of {item.tensor!r} holds {region}")
