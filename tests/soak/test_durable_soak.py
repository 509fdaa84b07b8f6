"""Soak of the durable path (marker ``slow``; DYNARL_SOAK_S seconds, 600 by default):
journal, sample source, manifest and checkpoints, one training step per iteration and a
migration plus a checkpoint every few steps. Memory must stop growing after the warm-up
(< 1 MB/min) and descriptors, sockets, processes and process groups come back to their
baseline. The skeleton the runtime's migration soak (issue 5) will grow from."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from soak_support import soak

from dynarl.runtime import CheckpointStore, Journal
from dynarl.runtime.durable._manifest import Manifest, ManifestConfig
from dynarl.runtime.durable._source import SampleSource, SourceConfig
from dynarl.types import Allocation, MigrationKind

pytestmark = pytest.mark.slow

DURATION_S = float(os.environ.get("DYNARL_SOAK_S", "600"))


@pytest.mark.timeout(DURATION_S + 300)
def test_the_durable_path_does_not_grow(tmp_path: Path) -> None:
    source = SampleSource(SourceConfig(seed=0, num_items=1000, group_size=8))
    manifest = Manifest(ManifestConfig(num_digests_kept=100))  # digests stay in the journal
    store = CheckpointStore(tmp_path / "checkpoints", num_keep=2)
    weights = torch.zeros(256, 256)
    allocations = [Allocation.of({"rollout": [0, 1], "trainer": [2, 3]}),
                   Allocation.of({"rollout": [0], "trainer": [1, 2, 3]})]  # fmt: skip
    with Journal(tmp_path / "journal") as journal:
        journal.commit(allocations[0])

        def body(step: int) -> None:
            nonlocal weights
            tickets = source.take(32)
            for ticket in tickets:
                manifest.issue(ticket.sample_id, step, max_tokens=16)
                attempt = manifest.dispatch(ticket.sample_id)
                manifest.generated(ticket.sample_id, attempt, num_tokens=16)
                manifest.scored(ticket.sample_id)
            manifest.trained(step, [t.sample_id for t in tickets])
            weights = weights + 1e-3
            journal.complete_step(
                step, cursor=source.cursor, digest=manifest.close_step(step).digest
            )
            if step % 10 == 9:
                target = allocations[(step // 10 + 1) % 2]
                mid = f"m{step}"
                journal.begin_migration(
                    migration_id=mid, kind=MigrationKind.P2P, component="trainer",
                    devices=[1], target=target, deadline=1e9,
                )  # fmt: skip
                for phase in ("prepare", "transfer", "verify"):
                    journal.record_step(mid, phase, ok=True)
                journal.commit(target, migration_id=mid)
                ref = store.save(steps_done=step + 1, version=step + 1, cursor=source.cursor,
                                 shards={0: {"weights": weights}})  # fmt: skip
                journal.record_checkpoint(steps_done=step + 1, path=ref.path, version=step + 1,
                                          cursor=ref.cursor, digest=ref.digest)  # fmt: skip

        report = soak(body, duration_s=DURATION_S, sample_every_s=DURATION_S / 60,
                      warmup_s=DURATION_S / 5)  # fmt: skip
    # WARNING, so that it shows with --log-cli-level=WARNING: capturing every INFO record of
    # a ten-minute loop would itself grow the process.
    logging.getLogger(__name__).warning(
        "%d steps in %.0f s: RSS growth %.0f B/min after warm-up, leaks %s",
        report.iterations, DURATION_S, report.growth_bytes_per_min, report.leaks,
    )  # fmt: skip
    assert manifest.report().ok
    assert report.growth_bytes_per_min < 1024 * 1024, report.growth_bytes_per_min
    assert report.leaks == ()
