"""DurableRun: a job's training loop made restartable and accounted, sample by sample.

Around a :class:`~dynarl.runtime.Job` started with ``JobConfig(durable=True)`` (whose
allocation journal it shares), a :class:`DurableRun` holds:

- the :class:`~dynarl.runtime.durable.SampleSource` the loop takes its tickets from;
- the :class:`~dynarl.runtime.durable.Manifest`, attached to the serving components'
  dispatchers so that every generation attempt (dispatch, abort, re-dispatch, final
  output) is accounted, then told of scoring and training;
- the :class:`~dynarl.runtime.durable.CheckpointStore` under ``run_dir/checkpoints``.

The loop: :meth:`DurableRun.issue` the step's tickets, generate, :meth:`DurableRun.train`
on the samples (every trainer component runs ``train_step``; the step closes in the
manifest and is journalled with the sample cursor and the step's digest; every
``checkpoint_every`` steps a checkpoint follows). A checkpoint binds, for every trainer
component, its state as each rank's role writes it (``save_state``) with the rank's RNG
states, the controller's RNG states, the model version (steps trained), the sample cursor
and each trainer's state checksum (when its role has a ``checksum`` method); it is
published through the store (fsynced, manifest last) and then journalled.

:meth:`DurableRun.open` resumes: it restores the journal's last checkpoint (fresh roles on
the allocation in force, state loaded, checksums verified, RNG restored), seeks the source
back to its cursor and makes the manifest expect the journalled digests of the steps to
redo, so a resumed job continues the very sample stream.

A worker that dies outside a migration is handled by the controller as a reclaim of its
device (``LossHandler``): a trainer that lost a rank then raises WorkerLostError from
:meth:`DurableRun.train` until it is restored, on the devices it still has or is given.
:meth:`DurableRun.recover` waits for that handling to end (raising the job's fatal error
when it cannot go on), starts again a worker that died inside a migration, reactivates
the serving roles that lived there, and says whether a trainer lost state (then
:meth:`DurableRun.restore`). Runs on the job's (the user's) event loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from dynarl.bus import MetaValue, Sample
from dynarl.errors import IntegrityError
from dynarl.runtime._job import Job
from dynarl.runtime._worker_protocol import (
    CallResult,
    Deactivate,
    Done,
    LoadState,
    RoleStatus,
    SaveState,
)
from dynarl.runtime.durable import (
    CheckpointRef,
    CheckpointStore,
    Journal,
    Manifest,
    ManifestConfig,
    ManifestReport,
    SampleSource,
    ShardRecord,
    SourceConfig,
    Ticket,
    capture_rng,
    restore_rng,
)
from dynarl.sched import MoveOutcome

__all__ = ["DurableConfig", "DurableRun", "Recovery"]

logger = logging.getLogger(__name__)

_CONTROLLER_SHARD = "controller"


@dataclass(frozen=True, kw_only=True, slots=True)
class DurableConfig:
    """What a durable run checkpoints, and how often."""

    source: SourceConfig
    """The sample stream."""
    trainers: tuple[str, ...] = ("trainer",)
    """Components trained every step and checkpointed (their roles implement
    ``save_state`` / ``load_state`` and ``train_step``)."""
    checkpoint_every: int = 1
    """Steps between two checkpoints."""
    num_keep: int = 2
    """Checkpoints kept on disk (>= 2: the journal may still name the previous one)."""
    max_tokens: int | None = None
    """Length limit of every sample (the manifest flags a partial re-dispatched at it)."""
    manifest: ManifestConfig = field(default_factory=ManifestConfig)
    """The accounting's rules."""

    def __post_init__(self) -> None:
        if not self.trainers:
            raise ValueError("DurableConfig.trainers must name at least one component")
        if self.checkpoint_every < 1:
            raise ValueError(
                f"DurableConfig.checkpoint_every must be >= 1, got {self.checkpoint_every}"
            )
        if self.num_keep < 2:
            raise ValueError(f"DurableConfig.num_keep must be >= 2, got {self.num_keep}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovery:
    """What :meth:`DurableRun.recover` found and did."""

    respawned: tuple[int, ...]
    """Devices whose worker was started again."""
    restore_needed: bool
    """Whether a trainer lost state (a rank died, or a move failed past its rollback or
    commit): call :meth:`DurableRun.restore` once the step's samples are collected."""


class DurableRun:
    """The restartable, accounted loop of one job (see the module docstring).

    Raises ValueError when the job is not durable or a trainer is not a component.
    """

    def __init__(self, job: Job, config: DurableConfig) -> None:
        if job.journal is None:
            raise ValueError("a DurableRun needs a job started with JobConfig(durable=True)")
        self.job, self.config = job, config
        self.journal: Journal = job.journal
        for name in config.trainers:
            job.controller.manager(name)
        self.store = CheckpointStore(job.run_dir / "checkpoints", num_keep=config.num_keep)
        self.source = SampleSource(config.source)
        self.manifest = Manifest(config.manifest)
        self.resumed_from: int | None = None
        """Steps done by the checkpoint the run last restored (None: never restored)."""
        self.checksums: dict[str, str] = {}
        """Each trainer's checksum after the last restore."""
        for name in config.trainers:
            job.controller.manager(name).recoverable = True
        for manager in job.controller.managers.values():
            if manager.dispatcher is not None:
                manager.dispatcher.accounting = self.manifest

    # ------------------------------------------------------------------ state

    @property
    def step(self) -> int:
        """The next step's index."""
        return self.journal.state.steps_done

    @property
    def checkpoint(self) -> CheckpointRef | None:
        """The last journalled checkpoint."""
        saved = self.journal.state.checkpoint
        return CheckpointRef.from_record(saved) if saved is not None else None

    def report(self) -> ManifestReport:
        """The sample manifest's report so far."""
        return self.manifest.report()

    async def open(self) -> DurableRun:
        """Resume where the journal says (restore its checkpoint if steps were done)."""
        state = self.journal.state
        if state.steps_done or state.checkpoint is not None:
            await self.restore()
        return self

    # ------------------------------------------------------------------ the loop

    def issue(self, num_samples: int) -> list[Ticket]:
        """The next ``num_samples`` tickets of the stream, issued for :attr:`step`."""
        tickets = self.source.take(num_samples)
        for ticket in tickets:
            self.manifest.issue(ticket.sample_id, self.step, max_tokens=self.config.max_tokens)
        return tickets

    async def train(
        self, samples: Sequence[Sample], **options: MetaValue
    ) -> dict[str, list[CallResult]]:
        """Train every trainer on ``samples`` (in this order) and close the step.

        Raises what :meth:`Job.call` raises (the step is then not journalled: recover);
        WorkerLostError when a trainer lost a rank (recover, then restore).
        """
        step = self.step
        for sample in samples:
            self.manifest.scored(sample.sample_id)
        results = {}
        for name in self.config.trainers:
            manager = self.job.controller.manager(name)
            results[name] = await manager.call("train_step", samples, dict(options))
        self.manifest.trained(step, [s.sample_id for s in samples])
        closed = self.manifest.close_step(step)
        self.journal.complete_step(step, cursor=self.source.cursor, digest=closed.digest)
        if (step + 1) % self.config.checkpoint_every == 0:
            await self.save()
        return results

    # ------------------------------------------------------------------ checkpoints

    async def save(self) -> CheckpointRef:
        """Checkpoint every trainer now, publish and journal it (see the module docstring).

        Raises what the workers' ``save_state`` raises (nothing is published then).
        """
        steps = self.step
        directory = self.store.begin(steps)
        shards: list[ShardRecord] = []
        metadata: dict[str, str | int | float | bool] = {}
        for name in self.config.trainers:
            manager = self.job.controller.manager(name)
            folder = directory / name
            folder.mkdir()
            async with manager.lock:
                await manager.ask_workers(SaveState(component=name, path=str(folder)), Done)
            metadata[f"{name}.devices"] = ",".join(map(str, manager.devices))
            sums = await self._checksums(name)
            if sums is not None:
                metadata[f"{name}.checksum"] = sums
            for path in sorted(folder.iterdir()):
                _fsync(path)
                shards.append(
                    ShardRecord(
                        rank=len(shards), file=f"{name}/{path.name}",
                        nbytes=path.stat().st_size, tensors=(),
                    )
                )  # fmt: skip
        folder = directory / _CONTROLLER_SHARD  # the controller's RNG states, last
        folder.mkdir()
        record = self.store.write_shard(folder, len(shards), {}, rng=capture_rng())
        shards.append(msgspec.structs.replace(record, file=f"{_CONTROLLER_SHARD}/{record.file}"))
        ref = self.store.publish(
            directory, steps_done=steps, version=steps, cursor=self.source.cursor,
            shards=shards, metadata=metadata,
        )  # fmt: skip
        self.journal.record_checkpoint(
            steps_done=steps, path=ref.path, version=ref.version, cursor=ref.cursor,
            digest=ref.digest,
        )  # fmt: skip
        return ref

    async def restore(self) -> CheckpointRef | None:
        """Roll every trainer back to the journal's last checkpoint (or its initial state
        when there is none), rewind the sample cursor and the manifest; the checkpoint.

        Fresh roles are started on each trainer's devices in the allocation in force,
        then loaded. Raises IntegrityError when the checkpoint does not match its
        journalled digest, a shard file its recorded size, or a restored state the
        checksum recorded with it.
        """
        ref = self.checkpoint
        manifest = self.store.manifest(ref) if ref is not None else None
        if ref is not None and manifest is not None:
            for shard in manifest.shards:
                size = (Path(ref.path) / shard.file).stat().st_size
                if size != shard.nbytes:
                    raise IntegrityError(f"checkpoint {ref.path}: {shard.file} has {size} bytes")
        self.checksums = {}
        for name in self.config.trainers:
            await self._fresh_roles(name)
            if ref is None:
                continue
            manager = self.job.controller.manager(name)
            message = LoadState(component=name, path=str(Path(ref.path) / name))
            async with manager.lock:
                await manager.ask_workers(message, Done)
            sums = await self._checksums(name)
            expected = manifest.metadata.get(f"{name}.checksum") if manifest else None
            if sums is not None and expected is not None and sums != expected:
                raise IntegrityError(f"{name} restored to checksum {sums}, saved {expected}")
            if sums is not None:
                self.checksums[name] = sums
        if ref is not None and manifest is not None:
            rng = manifest.shards[-1].rng
            if rng is not None:
                restore_rng(rng)
        steps, cursor = (ref.steps_done, ref.cursor) if ref is not None else (0, 0)
        self.source.seek(cursor)
        self.manifest.rewind(steps)
        for step, digest in self.journal.state.digests:
            if step >= steps:
                self.manifest.expect(step, digest)
        self.journal.restored(steps_done=steps, cursor=cursor, path=ref.path if ref else "")
        self.resumed_from = steps
        logger.warning("restored %s: %d steps done, sample cursor %d", ref, steps, cursor)
        return ref

    async def _fresh_roles(self, name: str) -> None:
        """Tear ``name``'s roles down wherever they live and start fresh ones on its
        devices in the allocation in force (a new layout epoch)."""
        controller = self.job.controller
        manager = controller.manager(name)
        devices = controller.allocation.devices(name)
        async with manager.lock:
            everywhere = sorted(controller.link.registered())
            await controller.link.ask_all(
                everywhere, Deactivate(component=name, keep=False), RoleStatus
            )
            manager.set_devices(devices)
            if devices:
                await manager.activate(devices, epoch=controller.coordinator.next_epoch())
            manager.restored()

    async def _checksums(self, name: str) -> str | None:
        role = self.job.controller.manager(name).spec.role
        if not callable(getattr(role, "checksum", None)):
            return None
        results = await self.job.call(name, "checksum")
        sums = {str(r.values.get("checksum")) for r in results}
        if len(sums) != 1:
            raise IntegrityError(f"{name}'s ranks disagree on its checksum: {sorted(sums)}")
        return sums.pop()

    # ------------------------------------------------------------------ faults

    async def recover(self, outcome: MoveOutcome | None = None) -> Recovery:
        """Wait until the controller handled every worker that died outside a migration
        (its device reclaimed), start again those that died inside one and reactivate
        the serving roles that lived there; whether a trainer must be restored (a rank
        of it died, or ``outcome`` — the last move's — left a trainer's migration failed).

        Raises the fatal WorkerLostError when the job cannot go on, WorkerError /
        TimeoutError as :meth:`Job.respawn` does.
        """
        controller = self.job.controller
        await controller.settled()
        running = self.job.workers()
        dead = {d for d in range(self.job.num_devices) if d not in running}
        respawned: tuple[int, ...] = ()
        if dead - controller.link.losses.reclaimed:  # a reclaimed device is not started again
            respawned = await self.job.respawn()
        allocation = controller.allocation
        lost = any(set(allocation.devices(t)) & set(respawned) for t in self.config.trainers)
        lost = lost or any(controller.manager(t).lost is not None for t in self.config.trainers)
        if outcome is not None:
            trainers = self.config.trainers
            lost = lost or any(
                r.outcome == "failed" and r.component in trainers for r in outcome.records
            )
        for name, manager in controller.managers.items():
            if name in self.config.trainers:
                continue
            devices = allocation.devices(name)
            again = [d for d in devices if d in respawned or d not in manager.devices]
            async with manager.lock:
                if again:
                    await manager.activate(again)
                manager.set_devices(devices)
            if manager.dispatcher is not None:
                for device in devices:
                    manager.dispatcher.add_worker(device)
        if respawned or lost:
            logger.warning("recovered workers %s; trainer state lost: %s", list(respawned), lost)
        return Recovery(respawned=respawned, restore_needed=lost)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
