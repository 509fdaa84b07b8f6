"""A durable job starts on the allocation its journal last committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynarl.runtime import ComponentSpec, Job, JobConfig
from dynarl.runtime._durable_run import DurableConfig
from dynarl.runtime._job import _recovered
from dynarl.runtime.durable._journal import Journal, recover
from dynarl.runtime.durable._source import SourceConfig
from dynarl.testing import ScriptedRollout, TinyTrainer
from dynarl.types import Allocation, MigrationKind

SPECS = [
    ComponentSpec(role=ScriptedRollout, devices=(0, 1)),
    ComponentSpec(role=TinyTrainer, devices=(2,)),
]


def test_a_restarted_job_takes_the_committed_allocation_and_rolls_back_one_in_flight(
    tmp_path: Path,
) -> None:
    grown = Allocation.of({"rollout": [0], "trainer": [1, 2]})
    with Journal(tmp_path / "journal") as journal:
        journal.commit(Allocation.of({"rollout": [0, 1], "trainer": [2]}))
        journal.begin_migration(
            migration_id="m1", kind=MigrationKind.P2P, component="trainer", devices=[1],
            target=grown, deadline=1e9,
        )  # fmt: skip
        journal.commit(grown, migration_id="m1")
        journal.begin_migration(
            migration_id="m2", kind=MigrationKind.P2P, component="rollout", devices=[1],
            target=Allocation.of({"rollout": [0, 1], "trainer": [2]}), deadline=1e9,
        )  # fmt: skip
        journal.record_step("m2", "prepare", ok=True)
        specs = _recovered(SPECS, journal)
    assert {s.name: s.devices for s in specs} == {"rollout": (0,), "trainer": (1, 2)}
    state = recover(tmp_path / "journal")
    assert state.in_flight is None and state.allocation == grown and state.epoch == 2


def test_constructing_a_job_opens_nothing_on_disk(tmp_path: Path) -> None:
    # The journal opens when the job starts (tests/unit/test_job_lifecycle.py).
    job = Job(SPECS, JobConfig(run_dir=str(tmp_path / "a"), durable=True))
    assert job.journal is None and not (tmp_path / "a").exists()
    temporary = Job(SPECS)
    assert temporary.journal is None and not temporary.run_dir.exists()


def test_durable_config_checks_its_fields() -> None:
    source = SourceConfig(seed=0, num_items=3)
    with pytest.raises(ValueError, match="checkpoint_every"):
        DurableConfig(source=source, checkpoint_every=0)
    with pytest.raises(ValueError, match="num_keep"):
        DurableConfig(source=source, num_keep=1)
    with pytest.raises(ValueError, match="trainers"):
        DurableConfig(source=source, trainers=())


def test_a_workers_rng_file_puts_its_generators_back(tmp_path: Path) -> None:
    import random

    import torch

    from dynarl.runtime.durable._rng import load_rng_file, save_rng_file

    assert not load_rng_file(tmp_path, 3)
    save_rng_file(tmp_path, 3)
    expected = (random.random(), torch.rand(3))
    random.random(), torch.rand(3)
    assert load_rng_file(tmp_path, 3)
    again = (random.random(), torch.rand(3))
    assert again[0] == expected[0] and torch.equal(again[1], expected[1])
