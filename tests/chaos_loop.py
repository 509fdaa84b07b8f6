"""The chaos driver: the durable fault loop across hosts, with seeded faults at event counts.

``python chaos_loop.py SETUP.json`` runs in host 0's namespace (started, and started again
after a controller kill, by ``tests/chaos.py``). The job is :mod:`fault_loop`'s across three
hosts as :mod:`partition_loop` builds it (device ``d`` on host ``d``, CURVE, the store on
host 0). Every step moves device 1 from the rollout to the trainer (a workload migration
and a P2P grow) and back. Before each move the driver asks :func:`fault_of` (seed, number
of steps attempted so far) — a pure function, so a restarted driver continues the same
plan — for the fault to arm: a worker kill or a link cut of a participant at one of the
move's phases, or a controller kill there. Faults fire at the
:class:`~dynarl.runtime.FaultInjector` barrier of that phase: at event counts (the ``n``-th
attempt's move, at its phase), never at a wall-clock moment.

After the move the driver heals (a cut worker leaves, its link comes back), recovers and
restores as the fault suite does, and logs one record per step to ``chaos-events.jsonl``
(append-only: it survives controller kills): the fault, the outcome (``old``, ``new``,
``restore``), the recovery time (from the move's start to the job serving again), the
processes' RSS and open fds. A controller kill writes its record before it fires; the
restarted driver records the resumption with the time since. At ``deadline`` (wall clock,
carried across restarts) it writes ``result.json``: journalled digests, the trainer's
checksum, the manifest's violations, lost and duplicated sample ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import fault_loop
import partition_loop
import psutil
from partition_loop import NetnsLauncher, Setup

from dynarl.runtime import Job
from dynarl.runtime._durable_run import DurableRun
from dynarl.runtime._faults import Fault, FaultAction
from dynarl.types import Allocation, MigrationKind

logger = logging.getLogger(__name__)

GROW = Allocation.of({"rollout": [0], "trainer": [1, 2]})
PHASES = (
    *(f"workload.{s}" for s in ("stop_routing", "drain", "release", "commit")),
    *(f"p2p.{s}" for s in ("prepare", "transfer", "verify", "commit")),
)
"""The phases the grow move reaches (the slow partition matrix fires at each of them)."""
FAULT_RATE = 0.7
"""Share of steps whose move gets a fault."""
ACTIONS = ((FaultAction.KILL, 0.4), (FaultAction.CUT, 0.4), (FaultAction.KILL_CONTROLLER, 0.2))


def fault_of(seed: int, attempt: int) -> Fault | None:
    """The fault armed before the move of the run's ``attempt``-th step (counted over
    the whole run: a step redone after a restore is a new attempt); None: a clean one.
    Attempt 0 is clean (it makes the first checkpoint). Pure."""
    rng = random.Random(f"{seed}:{attempt}")
    if attempt == 0 or rng.random() >= FAULT_RATE:
        return None
    actions, weights = zip(*ACTIONS, strict=True)
    action = rng.choices(actions, weights)[0]
    phase = rng.choice(PHASES)
    if action is FaultAction.KILL_CONTROLLER:
        return Fault(phase=phase, action=action)
    device = 1 if phase.startswith("workload") else rng.choice((1, 2))
    return Fault(phase=phase, action=action, device=device)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ChaosSetup:
    """``SETUP.json``: the hosts (as :class:`partition_loop.Setup`), the seed, the end."""

    hosts: dict[str, object]
    seed: int
    deadline: float
    """Wall-clock time (``time.time()``) after which no step starts."""
    stack: dict[str, object] = dataclasses.field(default_factory=lambda: {"name": "tiny"})
    """The rollout and trainer (``fault_loop.Stack.to_json``)."""


def resources(launcher: NetnsLauncher) -> dict[str, dict[str, int]]:
    """RSS (bytes) and open fds of the driver and of every worker it started."""
    pids = {"controller": os.getpid()} | {f"worker-{d}": p for d, p in launcher.pids().items()}
    out: dict[str, dict[str, int]] = {}
    for name, pid in pids.items():
        try:
            process = psutil.Process(pid)
            out[name] = {"rss": process.memory_info().rss, "fds": process.num_fds()}
        except psutil.Error:
            continue
    return out


class Events:
    """``chaos-events.jsonl``: one record per line, flushed and fsynced (a controller kill
    follows some of them at once). :attr:`attempts` counts the steps attempted so far, by
    every driver of the run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lines = path.read_text().splitlines() if path.exists() else []
        records = [json.loads(line) for line in lines]
        self.attempts = sum(1 for r in records if r["kind"] in ("step", "fault"))

    def add(self, **record: object) -> None:
        if record["kind"] in ("step", "fault"):
            self.attempts += 1
        with self.path.open("a") as out:
            out.write(json.dumps({"time": time.time(), **record}) + "\n")
            out.flush()
            os.fsync(out.fileno())


async def chaos_step(
    job: Job, run: DurableRun, launcher: NetnsLauncher, fault: Fault | None, events: Events
) -> None:
    """One step: submit, move device 1 to the trainer under ``fault``, heal, recover,
    train (or restore), move it back."""
    base = fault_loop.BASE
    if job.allocation != base:  # a controller killed past a commit point restarts on GROW
        back = await job.reallocate(base)
        assert back.ok, back.reason
    step = run.step
    tickets = fault_loop.submit(job, run)
    await asyncio.sleep(0.2)  # generations in flight on both engines
    started = time.monotonic()
    if fault is not None:
        if fault.action is FaultAction.KILL_CONTROLLER:
            events.add(kind="fault", step=step, action=str(fault.action), phase=fault.phase)
        job.faults.arm(fault)
    fired_before = len(job.faults.fired)
    outcome = await job.reallocate(GROW)
    job.faults.disarm()  # a fault the move did not reach must not hit the move back
    fired = len(job.faults.fired) > fired_before
    if fired and fault is not None and fault.action is FaultAction.CUT:
        assert fault.device is not None
        config = job.config.runtime
        await launcher.wait(fault.device, within_s=4 * partition_loop.leave_bound_s(config))
        launcher.restore(fault.device)
    recovery = await run.recover(outcome)
    samples = await fault_loop.collect(job, tickets)
    if recovery.restore_needed:
        await run.restore()
        result = "restore"
    else:
        result = "old" if job.allocation == base else "new"
        await fault_loop.train(job, run, samples)
    if job.allocation != base:
        back = await job.reallocate(base)
        assert back.ok, back.reason
    events.add(
        kind="step", step=step, action=str(fault.action) if fired and fault else None,
        phase=fault.phase if fired and fault else None, device=fault.device if fault else None,
        outcome=result, recovery_s=time.monotonic() - started if fired else None,
        reason=outcome.reason, resources=resources(launcher),
    )  # fmt: skip


async def drive(setup: ChaosSetup) -> None:
    hosts = Setup(**setup.hosts)  # type: ignore[arg-type]
    run_dir = Path(hosts.run_dir)
    events = Events(run_dir / "chaos-events.jsonl")
    config = partition_loop.runtime()
    launcher = NetnsLauncher(
        hosts, log_dir=run_dir / "workers", store_timeout_s=config.collective_timeout_s
    )
    job = fault_loop.job(
        run_dir, trainer=MigrationKind.P2P, config=config, launcher=launcher,
        stack=fault_loop.Stack.from_json(setup.stack),  # type: ignore[arg-type]
    )  # fmt: skip
    async with job:
        job.faults.cut = launcher.cut
        run = await fault_loop.durable(job).open()
        events.add(kind="open", resumed_from=run.resumed_from, resources=resources(launcher))
        while time.time() < setup.deadline:
            fault = fault_of(setup.seed, events.attempts)
            await chaos_step(job, run, launcher, fault, events)
        report = run.report()
        result = {
            "digests": fault_loop.journal_digests(run_dir),
            "checksum": await fault_loop.checksum(job),
            "violations": [v.kind for v in report.violations],
            "lost": list(report.lost), "duplicated": list(report.duplicated),
            "allocation": job.allocation.as_dict(),
        }  # fmt: skip
        events.add(kind="end", resources=resources(launcher))
    (run_dir / "result.json").write_text(json.dumps(result))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    setup = ChaosSetup(**json.loads(Path(sys.argv[1]).read_text()))
    Path(str(setup.hosts["run_dir"])).mkdir(parents=True, exist_ok=True)
    asyncio.run(drive(setup))


if __name__ == "__main__":
    main()
