"""The runtime end to end: real worker processes, real migrations, real rollbacks.

Each test runs one job on this machine (one worker process per device, gloo over the
job's TCPStore) and checks what the issue asks: the scheduler itself moves a device from
a tailing rollout to the trainer (workload migration, then P2P), each migration kind
commits with the trainer's state intact, an injected failure and a lapsed lease roll back
to the previous allocation, and every request comes out exactly once with the tokens an
uninterrupted generation would have produced.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

from dynarl.bus import (
    DecisionRecord,
    GenerationRequest,
    MigrationRecord,
    Sample,
    pack_tokens,
    unpack_tokens,
)
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.runtime._faults import Fault, FaultAction
from dynarl.runtime._worker_protocol import RESUMED
from dynarl.sched import ComponentProfile, ProfilePoint, SchedulerConfig
from dynarl.testing import ScriptedRollout, ShadowTrainer, TinyTrainer, scripted_token
from dynarl.types import MigrationKind

pytestmark = pytest.mark.dist


def generation(sample_id: str, prompt: Sequence[int], length: int) -> GenerationRequest:
    return GenerationRequest(
        sample_id=sample_id, token_ids=pack_tokens(prompt), max_new_tokens=length
    )


def assert_exactly_once(samples: list[Sample], requests: list[GenerationRequest]) -> None:
    """Every request came back once, with the tokens of an uninterrupted generation."""
    assert Counter(s.sample_id for s in samples) == Counter(r.sample_id for r in requests)
    by_id = {r.sample_id: r for r in requests}
    for sample in samples:
        request = by_id[sample.sample_id]
        prompt = [int(t) for t in unpack_tokens(request.token_ids)]
        positions = range(len(prompt), len(prompt) + request.max_new_tokens)
        tail = [scripted_token(0, sample.sample_id, p, 1000) for p in positions]
        assert list(unpack_tokens(sample.token_ids)) == prompt + tail, sample.sample_id
        assert sample.prompt_len == len(prompt)


def profile(*points: tuple[int, float], per_device: float = 0.0) -> ComponentProfile:
    return ComponentProfile(
        points=tuple(ProfilePoint(num_devices=n, throughput=t) for n, t in points),
        items_per_device=per_device,
    )


def test_the_scheduler_moves_a_tailing_rollout_device_to_the_trainer(tmp_path: Path) -> None:
    scheduler = SchedulerConfig(
        donor_window_s=1.0, stats_window_s=5.0, decision_interval_s=0.5, min_move_interval_s=0.0
    )
    config = JobConfig(
        run_dir=str(tmp_path),
        runtime=RuntimeConfig(scheduler=scheduler, report_interval_s=0.5),
    )
    trainer_options = {"step_s": 0.3}
    specs = [
        ComponentSpec(
            role=ScriptedRollout,
            devices=(0, 1),
            options={"tokens_per_s": 50.0, "kv_capacity": 4096},
            profile=profile((1, 4.0), (2, 8.0), per_device=8.0),
        ),
        ComponentSpec(
            role=TinyTrainer,
            devices=(2,),
            options=trainer_options,
            profile=profile((1, 1.0), (2, 2.0)),
        ),
    ]
    prompt = list(range(120))
    # Two long generations (one per engine) make the tail; fourteen short ones the burst.
    requests = [generation(f"s{i}", prompt, 400 if i < 2 else 40) for i in range(16)]

    async def main() -> tuple[list[Sample], list[list[Sample]], list[str], Job]:
        async with asyncio.timeout(240), Job(specs, config) as job:
            job.set_remaining("trainer", 64)
            job.submit("rollout", requests)
            out = job.output("rollout")
            samples: list[Sample] = []
            batches: list[list[Sample]] = []
            # The trainer trains on what has finished, one sample per step, and keeps
            # busy (re-training the latest sample) until the tail is over.
            while len(samples) < len(requests):
                try:
                    samples.append(await out.get(timeout=0.05))
                except TimeoutError:
                    if not samples:
                        continue
                batch = [samples[-1]]
                await job.call("trainer", "train_step", batch)
                batches.append(batch)
            sums = [r.values["checksum"] for r in await job.call("trainer", "checksum")]
            return samples, batches, sums, job

    samples, batches, sums, job = asyncio.run(main())
    assert_exactly_once(samples, requests)
    allocation = job.allocation
    assert allocation.count("rollout") == 1 and allocation.count("trainer") == 2
    decisions = [r for r in job.ledger.query(kind="decision", committed=True)]
    assert len(decisions) == 1
    decision = decisions[0]
    assert isinstance(decision, DecisionRecord)
    assert decision.donor == "rollout" and decision.receivers == ("trainer",)
    moved = set(job.allocation.devices("trainer")) - {2}
    records = job.ledger.query(kind="migration")
    assert {
        (r.component, r.kind, r.outcome) for r in records if isinstance(r, MigrationRecord)
    } == {
        ("rollout", "workload", "committed"),
        ("trainer", "p2p", "committed"),
    }
    assert all(isinstance(r, MigrationRecord) and r.dst_devices for r in records)
    # The long generation that ran on the device given away finished elsewhere.
    long_on_donor = [s for s in samples if s.sample_id in ("s0", "s1") and s.metadata[RESUMED]]
    assert long_on_donor and all(s.metadata["device"] not in moved for s in long_on_donor)
    # The trainer's state went through the reshard unchanged: every step after it gives
    # the state a single rank reaches with the same batches, bit for bit.
    assert len(set(sums)) == 1
    assert sums[0] == TinyTrainer.replay(trainer_options, batches)["checksum"]


def test_each_migration_kind_commits_and_failures_roll_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dynarl.sched")
    config = JobConfig(
        run_dir=str(tmp_path),
        runtime=RuntimeConfig(scheduler=SchedulerConfig(observe_only=True)),
    )
    specs = [
        ComponentSpec(role=ScriptedRollout, devices=(0, 1), options={"tokens_per_s": 40.0}),
        ComponentSpec(role=TinyTrainer, devices=(2,)),
        ComponentSpec(
            role=ShadowTrainer, devices=(3,), migration=MigrationKind.REBOOT, options={"seed": 5}
        ),
    ]
    prompt = [1, 2, 3, 4, 5]
    first = [generation(f"s{i}", prompt, 60 + 10 * i) for i in range(6)]
    second = [generation(f"t{i}", prompt, 80) for i in range(4)]
    outcomes: dict[str, tuple[bool, str, list[tuple[str, str, str]]]] = {}
    sums: dict[str, tuple[set[object], set[object]]] = {}

    async def main() -> tuple[list[Sample], Job]:
        async with asyncio.timeout(240), Job(specs, config) as job:

            async def checksums() -> tuple[set[object], set[object]]:
                trainer = await job.call("trainer", "checksum")
                shadow = await job.call("shadow", "checksum")
                return {r.values["checksum"] for r in trainer}, {
                    r.values["checksum"] for r in shadow
                }

            async def move(name: str, devices: list[int], src: str, dst: str, **kw: float) -> None:
                outcome = await job.move(devices, src=src, dst=dst, **kw)
                records = [(r.component, r.kind, r.outcome) for r in outcome.records]
                outcomes[name] = (outcome.ok, outcome.reason, records)
                sums[name] = await checksums()

            job.submit("rollout", first)
            await job.call("trainer", "train_step", [])
            await job.call("shadow", "train_step", [])
            sums["start"] = await checksums()
            await asyncio.sleep(0.5)  # generations are in flight on both engines
            await move("workload+p2p", [1], "rollout", "trainer")
            await move("p2p+reboot", [1], "trainer", "shadow")
            job.faults.arm(Fault(phase="p2p.transfer"))
            await move("failure", [1], "shadow", "trainer")
            job.faults.arm(Fault(phase="p2p.verify", action=FaultAction.STALL))
            await move("lease", [1], "shadow", "trainer", lease_s=5.0)
            await move("reboot+grow", [1], "shadow", "rollout")
            job.submit("rollout", second)
            await asyncio.sleep(0.5)
            job.faults.arm(Fault(phase="workload.redispatch"))
            await move("drain failure", [0], "rollout", "trainer")
            job.faults.arm(Fault(phase="workload.release"))
            await move("park failure", [0, 1], "rollout", "trainer")
            out = job.output("rollout")
            samples = [await out.get(timeout=60) for _ in first + second]
            assert job.controller.server.channels.sizes()[("rollout", "")] == 0
            return samples, job

    samples, job = asyncio.run(main())
    assert_exactly_once(samples, first + second)
    assert any(s.metadata[RESUMED] for s in samples)
    assert outcomes["workload+p2p"][:2] == (True, "")
    assert outcomes["workload+p2p"][2] == [
        ("rollout", "workload", "committed"),
        ("trainer", "p2p", "committed"),
    ]
    assert outcomes["p2p+reboot"][2] == [
        ("trainer", "p2p", "committed"),
        ("shadow", "reboot", "committed"),
    ]
    for name in ("failure", "lease"):
        ok, reason, records = outcomes[name]
        assert not ok and {state for _, _, state in records} == {"rolled_back"}, (name, reason)
    assert "injected failure" in outcomes["failure"][1]
    assert "lease expired" in outcomes["lease"][1]
    assert outcomes["reboot+grow"][2] == [
        ("shadow", "reboot", "committed"),
        ("rollout", "workload", "committed"),
    ]
    for name, step in (("drain failure", "redispatch"), ("park failure", "release")):
        ok, reason, records = outcomes[name]
        assert not ok and records == [("rollout", "workload", "rolled_back")] and step in reason
    # Every state survived every move and every rollback, on every rank.
    for name, pair in sums.items():
        assert pair == sums["start"] and all(len(s) == 1 for s in pair), name
    assert job.allocation.as_dict() == {"rollout": [0, 1], "shadow": [3], "trainer": [2]}
    recorded = job.ledger.query(kind="migration")
    assert len(recorded) == 12 and all(isinstance(r, MigrationRecord) for r in recorded)
    # The scheduler took each operator move as external: in force, and no move of its own.
    external = [r for r in caplog.records if r.getMessage().startswith("external move op")]
    assert len(external) == 7
    assert not [
        r
        for r in caplog.records
        if r.name.startswith("dynarl.sched") and r.levelno >= logging.WARNING
    ]
