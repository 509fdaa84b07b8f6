"""The Megatron-core trainer as a job's trainer role, resharded mid-step: nothing changes.

Two small jobs on two worker processes (a scripted rollout on device 0, the
``MegatronTrainerRole`` on device 1, gloo) train the same two streamed GRPO steps. Each step
learns its first two micro-batches, then its last two, then steps. In the moved job an
operator move grows the trainer onto device 0 by a P2P reshard between the two halves of
step 0 (so both ranks compute rows of that step), and shrinks it back before step 1 (the
rollout gets its device back and generates step 1). The test asserts that every step's
state checksum is the same on every rank and, bitwise, the same as in the job whose
trainer never moved; that the reshards kept the checksum; that the rank that joined
computed rows of the step; and that the weights really changed. A shrink attempted while
the leaving rank holds a row of the step is refused and rolled back. At the end the moved
trainer is parked (its last device given to the rollout: it sleeps there with its state),
woken again, and grown once more for one whole-batch step through Megatron DDP, which
agrees with the static job's (to float tolerance: DDP sums in another order). A third
job replays the static job's batches on a tp=2 trainer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynarl.backends.megatron import (
    GPTModelConfig,
    MegatronSetup,
    MegatronTrainConfig,
    MegatronTrainerRole,
)
from dynarl.bus import GenerationRequest, Sample, pack_tokens
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import SchedulerConfig
from dynarl.testing import ScriptedRollout

pytestmark = pytest.mark.dist

MODEL = GPTModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=128,
    max_sequence_length=64,
    init_seed=7,
)
SETUP = MegatronSetup(
    model=MODEL,
    train=MegatronTrainConfig(lr=3e-3, clip_grad=0.5, device="cpu", group_timeout_s=60),
    num_threads=1,
)
NUM_GROUPS, GROUP_SIZE, NUM_STEPS = 4, 3, 2


def requests(step: int) -> list[GenerationRequest]:
    """Step ``step``'s prompts, ``GROUP_SIZE`` samples each; the group is the micro-batch."""
    out = []
    for group in range(NUM_GROUPS):
        prompt = [(11 * step + 5 * group + j) % MODEL.vocab_size for j in range(5)]
        out += [
            GenerationRequest(
                sample_id=f"s{step}-g{group}-{i}",
                token_ids=pack_tokens(prompt),
                max_new_tokens=3 + (group + i) % 4,
                prompt_id=f"p{step}-{group}",
                metadata={"group": group, "seed_id": i},
            )
            for i in range(GROUP_SIZE)
        ]
    return out


def with_advantages(samples: list[Sample]) -> list[Sample]:
    """GRPO advantages per group, (r - mean) / (std + 1e-6), in the samples' metadata."""
    rewards: dict[object, list[float]] = {}
    for sample in samples:
        rewards.setdefault(sample.metadata["group"], []).append(float(sample.reward or 0.0))
    out = []
    for sample in samples:
        group = rewards[sample.metadata["group"]]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        advantage = (float(sample.reward or 0.0) - mean) / (std + 1e-6)
        metadata = {**sample.metadata, "advantage": advantage}
        out.append(msgspec.structs.replace(sample, metadata=metadata))
    return out


def group_of(sample: Sample) -> int:
    """The sample's micro-batch."""
    group = sample.metadata["group"]
    assert isinstance(group, int)
    return group


def one_value(results: list[Any], key: str) -> Any:
    """The value every rank returned under ``key`` (they must agree)."""
    values = {r.values[key] for r in results}
    assert len(values) == 1, (key, values)
    return values.pop()


async def checked_move(job: Job, devices: list[int], src: str, dst: str) -> tuple[Any, ...]:
    """Move ``devices``; whether it committed, why not, and whether the trainer's
    checksum is the same after as before."""
    before = one_value(await job.call("trainer", "checksum"), "checksum")
    outcome = await job.move(devices, src=src, dst=dst)
    after = one_value(await job.call("trainer", "checksum"), "checksum")
    return outcome.ok, outcome.reason, before == after


async def run(run_dir: Path, *, move: bool) -> dict[str, Any]:
    """Train ``NUM_STEPS`` streamed steps, then one whole-batch step; with ``move``, grow
    the trainer onto device 0 in the middle of step 0 (and try to shrink it before the
    step), shrink it after, park and wake it, and grow it for the whole-batch step."""
    specs = [
        ComponentSpec(
            role=ScriptedRollout,
            devices=(0,),
            options={"tokens_per_s": 200.0, "vocab": MODEL.vocab_size},
        ),
        ComponentSpec(role=MegatronTrainerRole, devices=(1,), options=SETUP.to_options()),
    ]
    # A rank that joins imports Megatron inside the migration's first step: generous
    # deadlines for that on two loaded cores.
    runtime = RuntimeConfig(
        scheduler=SchedulerConfig(observe_only=True),
        collective_timeout_s=90.0,
        request_timeout_s=120.0,
    )
    config = JobConfig(run_dir=str(run_dir), runtime=runtime)
    out: dict[str, Any] = {
        "sums": [], "losses": [], "norms": [], "moves": [], "computed": {}, "batches": [],
    }  # fmt: skip
    async with asyncio.timeout(170), Job(specs, config) as job:
        out["start"] = one_value(await job.call("trainer", "checksum"), "checksum")
        for step in range(NUM_STEPS):
            batch = requests(step)
            job.submit("rollout", batch)
            output = job.output("rollout")
            samples = with_advantages([await output.get(timeout=60) for _ in batch])
            out["batches"].append(samples)
            first = [s for s in samples if group_of(s) < NUM_GROUPS // 2]
            second = [s for s in samples if group_of(s) >= NUM_GROUPS // 2]
            await job.call("trainer", "learn", first)
            if move and step == 0:
                out["moves"].append(await checked_move(job, [0], "rollout", "trainer"))
            learned = await job.call("trainer", "learn", second)
            out["computed"][step] = {r.device: r.values["computed"] for r in learned}
            if move and step == 0:
                # Device 0 holds a row of the step: it refuses to leave, the move rolls back.
                out["refused"] = await checked_move(job, [0], "trainer", "rollout")
            result = await job.call(
                "trainer", "step", num_micros=NUM_GROUPS, num_samples=len(samples)
            )
            out["sums"].append(one_value(result, "checksum"))
            out["losses"].append(one_value(result, "loss"))
            out["norms"].append(one_value(result, "grad_norm"))
            if move and step == 0:
                out["moves"].append(await checked_move(job, [0], "trainer", "rollout"))
        if move:
            # Parked: the trainer gives its last device away and sleeps there with its state.
            before = one_value(await job.call("trainer", "checksum"), "checksum")
            parked = await job.move([1], src="trainer", dst="rollout")
            out["parked"] = (parked.ok, parked.reason, job.allocation.as_dict())
            woken = await job.move([1], src="rollout", dst="trainer")
            after = one_value(await job.call("trainer", "checksum"), "checksum")
            out["woken"] = (woken.ok, woken.reason, before == after)
            out["allocation"] = job.allocation.as_dict()
            out["moves"].append(await checked_move(job, [0], "rollout", "trainer"))
        # One whole-batch step through Megatron DDP (on two ranks in the moved job).
        result = await job.call("trainer", "train_step", samples)
        out["whole"] = (len(result), one_value(result, "loss"), one_value(result, "grad_norm"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("megatron-role")
    # The controller's cost model reads the trainer's layouts on its event loop; describing
    # the model (which imports Megatron) once here keeps that import off the loop.
    SETUP.param_specs()

    async def both() -> dict[str, dict[str, Any]]:
        return {
            "static": await run(root / "static", move=False),
            "moved": await run(root / "moved", move=True),
        }

    return asyncio.run(both())


def test_moves_commit_and_keep_the_state(runs: dict[str, dict[str, Any]]) -> None:
    moved = runs["moved"]
    # grow, shrink, grow again: each committed with the checksum unchanged.
    assert moved["moves"] == [(True, "", True)] * 3
    ok, reason, same = moved["refused"]
    assert not ok and "cannot leave before the step" in reason and same
    assert moved["parked"] == (True, "", {"rollout": [0, 1], "trainer": []})
    assert moved["woken"] == (True, "", True)
    assert moved["allocation"] == {"rollout": [0], "trainer": [1]}
    # Both ranks computed rows of step 0 after the grow; one rank before and after it.
    assert moved["computed"][0] == {0: "2", 1: "3"}
    assert runs["static"]["computed"][0] == {1: "2,3"}


def test_checksums_per_step_equal_the_run_that_never_moved(
    runs: dict[str, dict[str, Any]],
) -> None:
    static, moved = runs["static"], runs["moved"]
    assert moved["sums"] == static["sums"]
    assert moved["losses"] == static["losses"]
    assert len({static["start"], *static["sums"]}) == NUM_STEPS + 1
    # The steps really moved the weights (not only Adam's step counter).
    assert all(norm > 0 for norm in static["norms"])


def test_a_whole_batch_step_runs_on_one_and_on_two_ranks(
    runs: dict[str, dict[str, Any]],
) -> None:
    # DDP all-reduces gradients: the same step, not bitwise the same sums.
    (one, loss, norm), (two, loss2, norm2) = runs["static"]["whole"], runs["moved"]["whole"]
    assert (one, two) == (1, 2)
    assert loss2 == pytest.approx(loss, rel=1e-5) and norm2 == pytest.approx(norm, rel=1e-4)


def test_a_tensor_parallel_trainer_takes_the_same_steps(
    runs: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The static job's batches on a tp=2 trainer over both devices (no rollout): the same
    losses to float tolerance (TP splits the matrix products)."""
    setup = dataclasses.replace(SETUP, tp=2)
    specs = [ComponentSpec(role=MegatronTrainerRole, devices=(0, 1), options=setup.to_options())]
    runtime = RuntimeConfig(scheduler=SchedulerConfig(observe_only=True))

    async def main() -> list[float]:
        losses = []
        config = JobConfig(run_dir=str(tmp_path), runtime=runtime)
        async with asyncio.timeout(120), Job(specs, config) as job:
            for samples in runs["static"]["batches"]:
                await job.call("trainer", "learn", samples)
                result = await job.call(
                    "trainer", "step", num_micros=NUM_GROUPS, num_samples=len(samples)
                )
                assert len(result) == 2
                losses.append(one_value(result, "loss"))
        return losses

    losses = asyncio.run(main())
    assert losses == pytest.approx(runs["static"]["losses"], rel=1e-4)
