"""Fault injection into a running durable job (marker ``dist``; long variants ``slow``).

A job (rollout on devices 0 and 1, trainer on 2) trains step by step with one checkpoint
per step. Each case submits a step's generations, arms one fault through the
:class:`~dynarl.runtime.FaultInjector` seam, moves device 1 (the migration the fault hits),
lets :meth:`DurableRun.recover` start dead workers again, collects the step's samples and
then checks that the case ended in one of the three defined outcomes:

- ``old``: the previous allocation, the trainer's checksum unchanged (continuous);
- ``new``: the new allocation, the trainer's checksum unchanged (continuous);
- ``restore``: the trainer restored from the last checkpoint, its checksum equal to the
  checkpoint's and the sample cursor rewound to the checkpoint's.

After all its cases the job trains to the end; the journalled step digests and the final
checksum must equal an uninterrupted run's (computed in this process), and the sample
manifest must have no violation (nothing lost, nothing duplicated, redone steps equal to
their first run). Each case's outcome is asserted (it is determined by which participant
dies when) and logged as a table row (``FAULT-TABLE``). The controller kill and restart
runs the same loop in a driver process (:mod:`fault_loop`) killed mid-migration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fault_loop
import psutil
import pytest
from fault_loop import Case

from dynarl.runtime._faults import Fault, FaultAction
from dynarl.runtime.durable._journal import read_journal
from dynarl.runtime.durable._journal_records import MigrationBegun
from dynarl.types import Allocation, MigrationKind

pytestmark = pytest.mark.dist

logger = logging.getLogger(__name__)

TESTS = Path(__file__).resolve().parent.parent
BASE = Allocation.of({"rollout": [0, 1], "trainer": [2]})
GROW = Allocation.of({"rollout": [0], "trainer": [1, 2]})  # workload + P2P or reboot
SHRINK = Allocation.of({"rollout": [0], "trainer": [2]})  # workload only: device 1 freed
PHASES = {  # the prepare / transfer / commit, per migration kind
    "workload": {"prepare": "stop_routing", "transfer": "drain", "commit": "commit"},
    "p2p": {"prepare": "prepare", "transfer": "transfer", "commit": "commit"},
    "reboot": {"prepare": "save", "transfer": "restart", "commit": "commit"},
}


def kill(kind: str, phase: str, device: int, expected: str) -> Case:
    step = PHASES[kind][phase]
    fault = Fault(phase=f"{kind}.{step}", action=FaultAction.KILL, device=device)
    target = SHRINK if kind == "workload" else GROW
    return Case(name=f"SIGKILL {device} at {kind} {phase}", fault=fault, target=target,
                expected=expected)  # fmt: skip


def message(action: FaultAction, step: str, expected: str) -> Case:
    fault = Fault(phase=f"p2p.{step}", action=action, device=2)
    return Case(name=f"{action} p2p {step} message", fault=fault, target=GROW, expected=expected)


# Device 1 is the donor of a workload migration and the rank a P2P/reboot trainer grows
# onto; device 2 holds the trainer's only copy of its state until the move commits.
FAST = {
    "workload": [kill("workload", "transfer", 1, "old")],
    "p2p": [kill("p2p", "transfer", 2, "restore")],
    "reboot": [kill("reboot", "commit", 2, "restore")],
}
FULL = {
    "workload": [
        kill("workload", "prepare", 1, "old"),
        kill("workload", "transfer", 1, "old"),
        kill("workload", "commit", 1, "new"),
    ],
    "p2p": [
        kill("p2p", "prepare", 1, "old"),
        kill("p2p", "prepare", 2, "restore"),
        kill("p2p", "transfer", 1, "old"),
        kill("p2p", "transfer", 2, "restore"),
        kill("p2p", "commit", 1, "restore"),
        kill("p2p", "commit", 2, "restore"),
    ],
    "reboot": [
        kill("reboot", "prepare", 1, "old"),
        kill("reboot", "prepare", 2, "restore"),
        kill("reboot", "transfer", 1, "old"),
        kill("reboot", "transfer", 2, "restore"),
        kill("reboot", "commit", 1, "restore"),
        kill("reboot", "commit", 2, "restore"),
    ],
}
MESSAGES = [
    message(FaultAction.DUPLICATE, "prepare", "new"),
    message(FaultAction.DUPLICATE, "transfer", "new"),
    message(FaultAction.DUPLICATE, "commit", "new"),
    message(FaultAction.REORDER, "transfer", "new"),
    message(FaultAction.REORDER, "commit", "new"),
    message(FaultAction.DROP, "transfer", "old"),
]


def run_cases(tmp_path: Path, kind: MigrationKind, cases: list[Case]) -> None:
    trainer = MigrationKind.REBOOT if kind is MigrationKind.REBOOT else MigrationKind.P2P
    outcomes: dict[str, str] = {}

    async def main() -> tuple[str, list[str]]:
        async with asyncio.timeout(600), fault_loop.job(tmp_path, trainer=trainer) as job:
            run = await fault_loop.durable(job).open()
            await fault_loop.step(job, run)
            for case in cases:
                outcomes[case.name], _ = await fault_loop.run_case(job, run, case)
            while run.step < len(cases) + 2:
                await fault_loop.step(job, run)
            assert job.allocation == BASE
            same = await job.reallocate(BASE)  # the allocation in force: a durable no-op
            assert same.ok and same.records == (), same
            report = run.report()
            assert report.ok, report.violations
            return await fault_loop.checksum(job), fault_loop.journal_digests(tmp_path)

    checksum, digests = asyncio.run(main())
    assert outcomes == {case.name: case.expected for case in cases}
    expected_digests, expected_checksum = fault_loop.reference(len(digests))
    assert digests == expected_digests
    assert checksum == expected_checksum


@pytest.mark.parametrize("kind", list(MigrationKind))
def test_a_killed_participant_ends_in_a_defined_outcome(
    tmp_path: Path, kind: MigrationKind
) -> None:
    run_cases(tmp_path, kind, FAST[str(kind)])


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MigrationKind))
def test_every_phase_and_participant_killed(tmp_path: Path, kind: MigrationKind) -> None:
    run_cases(tmp_path, kind, FULL[str(kind)])


def test_dropped_duplicated_and_reordered_control_messages(tmp_path: Path) -> None:
    run_cases(tmp_path, MigrationKind.P2P, [MESSAGES[1], MESSAGES[3], MESSAGES[5]])


@pytest.mark.slow
def test_message_faults_at_every_phase(tmp_path: Path) -> None:
    run_cases(tmp_path, MigrationKind.P2P, MESSAGES)


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
            return True
        time.sleep(0.2)
    return False


def test_a_controller_killed_mid_migration_restarts_from_journal_and_checkpoint(
    tmp_path: Path,
) -> None:
    steps = 4
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    command = [sys.executable, str(TESTS / "fault_loop.py"), str(tmp_path), str(steps)]
    first = subprocess.run(
        [*command, "p2p.transfer"], env=env, capture_output=True, timeout=240, check=False
    )
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    orphans = [p for f in tmp_path.glob("workers-*.json") for p in json.loads(f.read_text())]
    try:  # the killed controller's workers leave once they miss its heartbeats
        assert _gone(orphans, 60.0), f"workers {orphans} outlived their controller"
    finally:
        for pid in orphans:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    second = subprocess.run(command, env=env, capture_output=True, timeout=240, check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    digests, checksum = fault_loop.reference(steps)
    assert result["violations"] == [] and result["resumed_from"] == 1, result
    assert result["digests"] == digests and result["checksum"] == checksum
    # The restarted controller numbered its moves past the first one's: no id twice.
    records = read_journal(tmp_path / "journal").records
    begun = [r.migration_id for r in records if isinstance(r, MigrationBegun)]
    logger.warning("migrations begun: %s", begun)
    assert len(begun) >= steps and len(set(begun)) == len(begun), begun
    logger.warning("FAULT-TABLE | SIGKILL controller | p2p.transfer | restore | restarted")
