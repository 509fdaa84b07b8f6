"""The durable training loop the fault-injection tests, the controller-restart driver and
the migration soak share: a rollout (``ScriptedRollout``) on devices 0 and 1, a trainer
(``TinyTrainer``) on device 2, samples from a seeded stream, one checkpoint per step.

Everything a step computes is deterministic (scripted tokens, a deterministic trainer),
so :func:`reference` computes, in this process and without any worker, the digests and
the checksum an uninterrupted run reaches; a run that survived faults must end there.

A :class:`Stack` swaps the components: ``megatron`` puts the production trainer
(``MegatronTrainerRole``: a tiny Megatron-core GPT on gloo, :data:`MEGATRON`) behind the
scripted rollout; ``reference`` runs the reference job's engine and trainer
(``ReferenceRollout``: the deterministic CPU decoder, ``ReferenceTrainer``: the reference
GPT as a Megatron GPTModel) from a weights file. Their trainers step by the
layout-independent streamed step (``train_step(streamed=True)``: bitwise the same on one
rank or two) with the GRPO advantages the requests carry, and the uninterrupted run's
checksum comes from running the loop without faults or moves (:func:`clean_run`). The
reference engines keep the initial weights (no weight sync: a worker started again after
a fault loads the weights file, and must serve what an uninterrupted run's would).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dynarl.backends.megatron import (
    GPTModelConfig,
    MegatronSetup,
    MegatronTrainConfig,
    MegatronTrainerRole,
)
from dynarl.backends.reference import ReferenceRollout, ReferenceSetup, ReferenceTrainer
from dynarl.bus import GenerationRequest, MetaValue, Sample, pack_tokens
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.runtime._durable_run import DurableConfig, DurableRun
from dynarl.runtime._faults import Fault
from dynarl.runtime.durable._journal import read_journal
from dynarl.runtime.durable._journal_records import StepCompleted
from dynarl.runtime.durable._manifest import step_digests
from dynarl.runtime.durable._source import SampleSource, SourceConfig, Ticket
from dynarl.runtime.launch import WorkerLauncher
from dynarl.sched import SchedulerConfig
from dynarl.testing import ScriptedRollout, TinyTrainer, scripted_token
from dynarl.types import Allocation, MigrationKind

logger = logging.getLogger(__name__)

SOURCE = SourceConfig(seed=3, num_items=7, group_size=2)
BATCH = 4
MAX_NEW = 24
TRAINER = {"hidden": 16, "num_layers": 1, "group_timeout_s": 4.0}
OUTCOMES = ("old", "new", "restore")
BASE = Allocation.of({"rollout": [0, 1], "trainer": [2]})
"""The allocation the job starts with."""


MEGATRON = MegatronSetup(
    model=GPTModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, vocab_size=1000, max_sequence_length=64, init_seed=7,
    ),
    train=MegatronTrainConfig(lr=3e-3, clip_grad=0.5, device="cpu", group_timeout_s=20.0),
    num_threads=1,
)  # fmt: skip
"""The production trainer's setup (the ``megatron`` stack): its vocabulary covers the
scripted tokens (< 1000)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Stack:
    """The loop's rollout and trainer (see the module docstring)."""

    name: str = "tiny"
    """``tiny``, ``megatron`` or ``reference``."""
    setup: ReferenceSetup | None = None
    """The reference job's setup, its initial weights file included (``reference``)."""

    def __post_init__(self) -> None:
        if self.name not in ("tiny", "megatron", "reference"):
            raise ValueError(f"unknown stack {self.name!r}")
        if (self.name == "reference") != (self.setup is not None):
            raise ValueError("a ReferenceSetup goes with the reference stack, and only there")

    def components(self, trainer: MigrationKind) -> list[ComponentSpec]:
        """The rollout on devices 0 and 1, the trainer (moving by ``trainer``) on 2."""
        if self.setup is not None:
            options = self.setup.to_options()
            return [
                ComponentSpec(role=ReferenceRollout, devices=(0, 1), options=options),
                ComponentSpec(
                    role=ReferenceTrainer, devices=(2,), options=options, migration=trainer
                ),
            ]
        rollout = ComponentSpec(
            role=ScriptedRollout, devices=(0, 1), options={"tokens_per_s": 60.0}
        )
        if self.name == "tiny":
            return [
                rollout,
                ComponentSpec(role=TinyTrainer, devices=(2,), options=TRAINER, migration=trainer),
            ]
        MEGATRON.param_specs()  # imports Megatron here, not on the controller's event loop
        options = MEGATRON.to_options()
        learner = ComponentSpec(
            role=MegatronTrainerRole, devices=(2,), options=options, migration=trainer
        )
        return [rollout, learner]

    def to_json(self) -> dict[str, MetaValue]:
        return {"name": self.name} | (self.setup.to_options() if self.setup else {})

    @classmethod
    def from_json(cls, data: dict[str, MetaValue]) -> Stack:
        name = str(data["name"])
        setup = ReferenceSetup.from_options(data) if name == "reference" else None
        return cls(name=name, setup=setup)


TINY = Stack()


def request(ticket: Ticket, index: int) -> GenerationRequest:
    """``ticket``'s generation request, ``index``-th of its step: its micro-batch (the
    prompt group within the step), its order there and sampling key (its stream position)
    and a fixed GRPO advantage (+1 for the first member, -1 for the others: the Megatron
    trainer's loss needs one)."""
    metadata: dict[str, MetaValue] = {
        "group": index // SOURCE.group_size,
        "seed_id": ticket.position,
        "advantage": 1.0 if ticket.member == 0 else -1.0,
    }
    return GenerationRequest(
        sample_id=ticket.sample_id, token_ids=pack_tokens([ticket.item, ticket.member]),
        max_new_tokens=MAX_NEW, prompt_id=ticket.prompt_id, seed=ticket.seed, metadata=metadata,
    )  # fmt: skip


def expected_sample(ticket: Ticket) -> Sample:
    """The sample an uninterrupted generation of ``ticket`` ends with."""
    prompt = [ticket.item, ticket.member]
    positions = range(len(prompt), len(prompt) + MAX_NEW)
    tail = [scripted_token(0, ticket.sample_id, p, 1000) for p in positions]
    return Sample(sample_id=ticket.sample_id, token_ids=pack_tokens(prompt + tail), prompt_len=2)


def reference(num_steps: int) -> tuple[list[str], str]:
    """(step digests, final trainer checksum) of an uninterrupted run."""
    source = SampleSource(SOURCE)
    batches = [[expected_sample(t) for t in source.take(BATCH)] for _ in range(num_steps)]
    digests = [step_digests(i, [s.sample_id for s in b])[0] for i, b in enumerate(batches)]
    return digests, str(TinyTrainer.replay(TRAINER, batches)["checksum"])


def journal_digests(run_dir: Path) -> list[str]:
    """The digest each step was first journalled with, by step."""
    first: dict[int, str] = {}
    for record in read_journal(run_dir / "journal").records:
        if isinstance(record, StepCompleted):
            first.setdefault(record.step, record.digest)
    return [first[s] for s in sorted(first)]


def runtime(faults: Sequence[Fault] = ()) -> RuntimeConfig:
    """Short deadlines (a dead participant costs seconds), no autonomous moves."""
    return RuntimeConfig(
        scheduler=SchedulerConfig(observe_only=True), collective_timeout_s=4.0,
        request_timeout_s=8.0, drain_timeout_s=8.0, lease_s=40.0, faults=tuple(faults),
    )  # fmt: skip


def job(
    run_dir: Path,
    *,
    trainer: MigrationKind = MigrationKind.P2P,
    faults: Sequence[Fault] = (),
    config: RuntimeConfig | None = None,
    launcher: WorkerLauncher | None = None,
    stack: Stack = TINY,
) -> Job:
    """The loop's job (``config`` default: :func:`runtime` with ``faults``; ``launcher``
    default: the local one)."""
    specs = stack.components(trainer)
    settings = config if config is not None else runtime(faults)
    job_config = JobConfig(run_dir=str(run_dir), runtime=settings, durable=True)
    return Job(specs, job_config, launcher=launcher)


def durable(job: Job) -> DurableRun:
    return DurableRun(job, DurableConfig(source=SOURCE, checkpoint_every=1, max_tokens=MAX_NEW))


def submit(job: Job, run: DurableRun) -> list[Ticket]:
    """Issue the next step's tickets and hand them to the rollout."""
    tickets = run.issue(BATCH)
    job.submit("rollout", [request(t, i) for i, t in enumerate(tickets)])
    return tickets


async def train(job: Job, run: DurableRun, samples: Sequence[Sample]) -> None:
    """Train the step on ``samples`` (the production trainer by its layout-independent
    streamed step)."""
    if issubclass(job.controller.manager("trainer").spec.role, MegatronTrainerRole):
        await run.train(samples, streamed=True)
    else:
        await run.train(samples)


async def collect(job: Job, tickets: Sequence[Ticket], timeout_s: float = 90.0) -> list[Sample]:
    """The step's samples, in ticket order (the canonical update order)."""
    out = job.output("rollout")
    got: dict[str, Sample] = {}
    async with asyncio.timeout(timeout_s):
        while len(got) < len(tickets):
            sample = await out.get()
            assert sample.sample_id not in got, f"{sample.sample_id} delivered twice"
            got[sample.sample_id] = sample
    assert set(got) == {t.sample_id for t in tickets}
    return [got[t.sample_id] for t in tickets]


async def step(job: Job, run: DurableRun) -> None:
    """One whole, fault-free step."""
    tickets = submit(job, run)
    await train(job, run, await collect(job, tickets))


async def clean_run(run_dir: Path, num_steps: int, stack: Stack) -> tuple[list[str], str]:
    """(step digests, final trainer checksum) of the loop run ``num_steps`` steps without a
    fault or a move, in a job of its own: the uninterrupted run of a stack that
    :func:`reference` cannot replay in-process."""
    async with job(run_dir, stack=stack) as running:
        run = await durable(running).open()
        while run.step < num_steps:
            await step(running, run)
        return journal_digests(run_dir), await checksum(running)


async def checksum(job: Job) -> str:
    sums = {str(r.values["checksum"]) for r in await job.call("trainer", "checksum")}
    assert len(sums) == 1, sums
    return sums.pop()


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One fault, and the outcome it must produce (``expected`` None: any of
    :data:`OUTCOMES`, the invariants checked all the same)."""

    name: str
    fault: Fault
    target: Allocation
    expected: str | None


async def run_case(
    job: Job,
    run: DurableRun,
    case: Case,
    *,
    after: Callable[[Case], Awaitable[None]] | None = None,
) -> tuple[str, str]:
    """Inject ``case``'s fault into a move during a step; (the outcome it produced, the
    move's reason). ``after`` runs once the move ended, before recovery (a cut link is
    restored there)."""
    base = job.allocation
    tickets = submit(job, run)
    await asyncio.sleep(0.2)  # generations in flight on both engines
    before = await checksum(job)
    job.faults.arm(case.fault)
    outcome = await job.reallocate(case.target)
    assert job.faults.fired and job.faults.fired[-1] == case.fault, "the fault never fired"
    if after is not None:
        await after(case)
    recovery = await run.recover(outcome)
    samples = await collect(job, tickets)
    if recovery.restore_needed:
        saved = run.checkpoint
        assert saved is not None
        await run.restore()
        checksum_saved = run.store.manifest(saved).metadata["trainer.checksum"]
        assert run.checksums["trainer"] == checksum_saved == await checksum(job)
        assert run.source.cursor == saved.cursor and run.step == saved.steps_done
        result = "restore"
    else:
        assert await checksum(job) == before, "the trainer's state changed"
        assert job.allocation in (base, case.target), job.allocation
        result = "old" if job.allocation == base else "new"
        assert outcome.ok == (result == "new") or case.fault.phase.endswith("commit")
        await train(job, run, samples)
    if job.allocation != base:
        back = await job.reallocate(base)
        assert back.ok, back.reason
    logger.warning(
        "FAULT-TABLE | %s | %s | %s | %s", case.name, case.fault.phase, result, outcome.reason
    )
    return result, outcome.reason


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    """What a driver run ends with (``result.json``)."""

    digests: list[str]
    checksum: str
    violations: list[str]
    resumed_from: int | None
    allocation: dict[str, list[int]]


async def drive(run_dir: Path, num_steps: int, faults: Sequence[Fault], arm_at: int = 1) -> Result:
    """Run (or resume) the loop to ``num_steps`` steps; moves device 1 to the trainer
    and back every step, so that ``faults`` (armed before step ``arm_at``) meet one."""
    async with job(run_dir) as running:
        pids = run_dir / f"workers-{os.getpid()}.json"
        pids.write_text(json.dumps(sorted(running.workers().values())))
        run = await durable(running).open()
        while run.step < num_steps:
            if run.step == arm_at:
                for fault in faults:
                    running.faults.arm(fault)
            tickets = submit(running, run)
            await asyncio.sleep(0.2)  # generations in flight on both engines
            give = run.step % 2 == 0
            src, dst = ("rollout", "trainer") if give else ("trainer", "rollout")
            if 1 in running.allocation.devices(src):
                await running.move([1], src=src, dst=dst)
            await train(running, run, await collect(running, tickets))
        result = Result(
            digests=journal_digests(run_dir), checksum=await checksum(running),
            violations=[v.kind for v in run.report().violations],
            resumed_from=run.resumed_from, allocation=running.allocation.as_dict(),
        )  # fmt: skip
    return result


def main() -> None:
    """The controller-restart driver: ``python fault_loop.py RUN_DIR STEPS [PHASE]``;
    with PHASE the controller SIGKILLs itself there (once per run directory)."""
    import sys

    from dynarl.runtime._faults import FaultAction

    logging.basicConfig(level=logging.WARNING)
    run_dir, num_steps = Path(sys.argv[1]), int(sys.argv[2])
    marker = run_dir / "killed"
    faults = []
    if len(sys.argv) > 3 and not marker.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
        faults.append(Fault(phase=sys.argv[3], action=FaultAction.KILL_CONTROLLER))
    result = asyncio.run(drive(run_dir, num_steps, faults))
    (run_dir / "result.json").write_text(json.dumps(dataclasses.asdict(result)))


if __name__ == "__main__":
    main()
