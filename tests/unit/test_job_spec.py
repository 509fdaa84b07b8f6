"""JobSpec: a job in one module, validated; what the torchrun entry makes of ``--job``; the
launcher of a torchrun job (the ranks are the workers: it only publishes their settings
and opens the rendezvous)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import standin_job
import torchrun_jobs

import dynarl
from dynarl._distenv import DistEnv
from dynarl.errors import WorkerError
from dynarl.runtime.launch._job_ranks import RankLauncher
from dynarl.runtime.launch._torchrun import ControllerContext, LaunchConfig, load_job
from dynarl.runtime.worker import WorkerOptions
from dynarl.testing import ScriptedRollout


async def drive(job: dynarl.Job) -> None:
    return None


def test_a_spec_keeps_its_components_as_a_tuple_and_counts_its_devices() -> None:
    spec = dynarl.JobSpec(components=list(torchrun_jobs.COMPONENTS), driver=drive)
    assert spec.components == torchrun_jobs.COMPONENTS
    assert spec.num_devices == 2 and spec.config == dynarl.JobConfig()
    assert torchrun_jobs.TOO_BIG.num_devices == 3
    wider = dataclasses.replace(spec, config=dynarl.JobConfig(num_devices=4))
    assert wider.num_devices == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.driver = drive  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"components": ()}, "at least one component"),
        ({"components": ("rollout",)}, "must be ComponentSpecs"),
        (
            {
                "components": (
                    dynarl.ComponentSpec(role=ScriptedRollout, devices=(0,)),
                    dynarl.ComponentSpec(role=ScriptedRollout, devices=(1,)),
                )
            },
            "two components are named 'rollout'",
        ),
        ({"driver": "drive"}, "driver must be an async function"),
        ({"config": {"num_devices": 2}}, "config must be a JobConfig"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(changes: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"components": torchrun_jobs.COMPONENTS, "driver": drive, **changes}
    with pytest.raises(ValueError, match=message):
        dynarl.JobSpec(**fields)


def context(
    tmp_path: Path, store: FakeStore, announced: list[str], world: int
) -> ControllerContext:
    return ControllerContext(
        env=DistEnv(rank=0, world_size=world),
        config=LaunchConfig(job="torchrun_jobs:failing", job_dir=tmp_path, args=("--x",)),
        store=cast(Any, store),
        bind_address="tcp://127.0.0.1:0",
        curve=None,
        announce=announced.append,
    )


class FakeStore:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value


def test_the_launcher_names_a_spec_a_factory_or_a_launched_job(tmp_path: Path) -> None:
    assert load_job("standin_job:JOB") is standin_job.JOB
    for name in ("torchrun_jobs:failing", "torchrun_jobs:TOO_BIG"):
        job = load_job(name)
        assert callable(job.controller) and callable(job.worker)
    too_big = load_job("torchrun_jobs:TOO_BIG")
    ctx = context(tmp_path, FakeStore(), [], world=2)
    with pytest.raises(ValueError, match="needs 3 devices but torchrun started 2 ranks"):
        too_big._spec(ctx)  # type: ignore[attr-defined]
    # On rank 0 a factory gets the job's arguments; the run directory is --job-dir and
    # the job has a device per rank.
    factory = load_job("torchrun_jobs:failing")
    spec = factory._spec(context(tmp_path, FakeStore(), [], world=3))  # type: ignore[attr-defined]
    assert spec.config.run_dir == str(tmp_path) and spec.config.num_devices == 3
    assert spec.components == torchrun_jobs.COMPONENTS


def test_the_rank_launcher_publishes_the_settings_then_admits_the_ranks(tmp_path: Path) -> None:
    store, announced = FakeStore(), []
    launcher = RankLauncher(context(tmp_path, store, announced, world=2))
    assert launcher.store is store and launcher.bind == "tcp://127.0.0.1:0"
    assert launcher.curve is None and launcher.exited() == () and launcher.pids() == {}
    workers = [
        WorkerOptions(controller="tcp://127.0.0.1:5555", device=d, metrics_interval_s=0.2)
        for d in (0, 1)
    ]

    async def main() -> None:
        async with launcher:
            with pytest.raises(WorkerError, match="beyond the 2 ranks"):
                await launcher.start([dataclasses.replace(workers[0], device=2)])
            assert announced == []
            await launcher.start(workers)

    asyncio.run(main())
    assert announced == ["tcp://127.0.0.1:5555"]
    settings = msgspec.json.decode(store.values["worker-options"], type=WorkerOptions)
    assert settings == workers[0]
    with pytest.raises(WorkerError, match="torchrun owns its process"):
        launcher.kill(1)
    launcher.check()  # a lost rank is the controller's to find, as a lost peer
