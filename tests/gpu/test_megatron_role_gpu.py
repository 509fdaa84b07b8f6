"""The Megatron trainer role on CUDA in a real job, and its weight push to the fake SGLang
server (marker ``gpu``; skipped without CUDA).

1. ``MegatronTrainerRole`` with ``device="cuda"`` in a :class:`~dynarl.runtime.Job` of two
   worker processes, the trainer on device 0 and device 1 free. One streamed GRPO step
   learns its first two micro-batches on device 0; an operator reallocation grows the
   trainer onto (0, 1) by a P2P reshard over NCCL; the last two micro-batches are learned
   one on each rank, and the step sums the rows of both. A whole-batch step through
   Megatron DDP follows on both ranks, then the trainer shrinks back to (0,) and takes one
   more step alone. The state's checksum is the same before and after each move, the same
   on every rank after each step, and different after each step. Each worker trains on the
   GPU of its device index (the role makes it current): two NCCL ranks cannot share one
   GPU, so this needs two.
2. :func:`push_to_engines` from a CUDA trainer to the fake SGLang server as a version: the
   fake then reports that version, and its ``/weights_checker`` checksums are those of the
   trainer's weights, recomputed here. Over gloo (one GPU: the fake receives into host
   memory) and over NCCL (two GPUs: the fake receives on the second, as an engine on
   its own device does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dynarl.backends._grpo import TrainSample
from dynarl.backends.megatron import (
    EngineTarget,
    GPTModelConfig,
    MegatronSetup,
    MegatronTrainConfig,
    MegatronTrainer,
    MegatronTrainerRole,
    describe,
    push_to_engines,
    to_hf,
)
from dynarl.backends.reference import solo_process_group
from dynarl.backends.sglang import (
    SGLangServer,
    SGLangServerConfig,
    SGLangServerEngine,
    checksum_mismatches,
    expected_checksums,
)
from dynarl.bus import Sample, pack_tokens
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import SchedulerConfig

pytestmark = [
    pytest.mark.gpu,
    # Megatron 0.16.1's RowParallelLinear warns on rank 0 that it passes no group.
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

MODEL = GPTModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=128, vocab_size=256, max_sequence_length=64, init_seed=7,
)  # fmt: skip
SETUP = MegatronSetup(
    model=MODEL,
    train=MegatronTrainConfig(lr=3e-3, clip_grad=0.5, device="cuda", group_timeout_s=120),
)
NUM_GROUPS, GROUP_SIZE = 4, 3


def samples(step: int) -> list[Sample]:
    """Step ``step``'s samples: ``NUM_GROUPS`` micro-batches of ``GROUP_SIZE``, advantages
    -1, 0, 1 in each."""
    out = []
    for group in range(NUM_GROUPS):
        prompt = [(11 * step + 5 * group + j) % MODEL.vocab_size for j in range(5)]
        for i in range(GROUP_SIZE):
            response = [(7 * step + 3 * group + 5 * i + j) % MODEL.vocab_size for j in range(4)]
            out.append(
                Sample(
                    sample_id=f"s{step}-g{group}-{i}",
                    token_ids=pack_tokens(prompt + response[: 2 + (group + i) % 3]),
                    prompt_len=len(prompt),
                    metadata={"group": group, "seed_id": i, "advantage": i - 1.0},
                )
            )
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


async def checked_move(job: Job, devices: tuple[int, ...]) -> tuple[Any, ...]:
    """Reallocate the trainer to ``devices``: whether it committed, why not, and whether
    the trainer's checksum is the same after as before."""
    before = one_value(await job.call("trainer", "checksum"), "checksum")
    outcome = await job.reallocate({"trainer": devices})
    after = one_value(await job.call("trainer", "checksum"), "checksum")
    return outcome.ok, outcome.reason, before == after


async def grow_and_shrink(run_dir: Path) -> dict[str, Any]:
    """The job of test 1 (see the module docstring); what it observed."""
    specs = [ComponentSpec(role=MegatronTrainerRole, devices=(0,), options=SETUP.to_options())]
    # The rank that joins imports Megatron and builds its CUDA state inside the migration.
    runtime = RuntimeConfig(
        scheduler=SchedulerConfig(observe_only=True),
        collective_timeout_s=120.0,
        request_timeout_s=180.0,
    )
    config = JobConfig(num_devices=2, run_dir=str(run_dir), runtime=runtime)
    out: dict[str, Any] = {"moves": [], "sums": [], "losses": [], "norms": []}

    def record(result: list[Any]) -> None:
        out["sums"].append(one_value(result, "checksum"))
        out["losses"].append(one_value(result, "loss"))
        out["norms"].append(one_value(result, "grad_norm"))

    async with asyncio.timeout(270), Job(specs, config) as job:
        out["start"] = one_value(await job.call("trainer", "checksum"), "checksum")
        batch = samples(0)
        first = [s for s in batch if group_of(s) < NUM_GROUPS // 2]
        second = [s for s in batch if group_of(s) >= NUM_GROUPS // 2]
        await job.call("trainer", "learn", first)
        out["moves"].append(await checked_move(job, (0, 1)))
        learned = await job.call("trainer", "learn", second)
        out["computed"] = {r.device: r.values["computed"] for r in learned}
        result = await job.call("trainer", "step", num_micros=NUM_GROUPS, num_samples=len(batch))
        out["ranks"] = len(result)
        record(result)
        whole = await job.call("trainer", "train_step", samples(1))
        out["whole"] = (len(whole), one_value(whole, "loss"), one_value(whole, "grad_norm"))
        out["moves"].append(await checked_move(job, (0,)))
        out["allocation"] = job.allocation.as_dict()
        batch = samples(2)
        await job.call("trainer", "learn", batch)
        result = await job.call("trainer", "step", num_micros=NUM_GROUPS, num_samples=len(batch))
        out["alone"] = len(result)
        record(result)
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two NCCL ranks need two GPUs")
def test_the_trainer_role_grows_and_shrinks_on_cuda_keeping_its_state(tmp_path: Path) -> None:
    # The controller's cost model reads the trainer's layouts on its event loop: describe
    # the model (importing Megatron) here first.
    SETUP.param_specs()
    out = asyncio.run(grow_and_shrink(tmp_path))
    # Grown over NCCL, then shrunk: both committed, the checksum unchanged by each.
    assert out["moves"] == [(True, "", True), (True, "", True)], out["moves"]
    assert out["computed"] == {0: "2", 1: "3"}
    assert (out["ranks"], out["whole"][0], out["alone"]) == (2, 2, 1)
    assert out["allocation"] == {"trainer": [0]}
    # Every step changed the state, with non-zero gradients (the weights, not only Adam's
    # counter).
    assert len({out["start"], *out["sums"]}) == 3
    assert all(math.isfinite(x) for x in [*out["losses"], out["whole"][1]])
    assert all(norm > 0 for norm in [*out["norms"], out["whole"][2]])


# ---------------------------------------------------------------------- the push

VERSION = "7"
PUSH_DTYPE = "bfloat16"
"""The pushing trainer's parameters (and the fake engine's weights)."""


def batch(seed: int) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(4):
        tokens = torch.randint(0, MODEL.vocab_size, (12 + i,), generator=gen).tolist()
        mask = tuple([False] * 3 + [True] * (8 + i))
        out.append(TrainSample(tokens=tuple(tokens), loss_mask=mask, advantage=i - 1.5))
    return out


@pytest.fixture
def solo() -> Iterator[Any]:
    torch.cuda.set_device(0)
    with solo_process_group():
        yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2,
                reason="an NCCL push needs a second GPU for the engine's end",
            ),
        ),
    ],
)
def test_push_to_engines_from_a_cuda_trainer_reaches_the_fake_sglang_server(
    solo: Any, tmp_path: Path, backend: str
) -> None:
    model = dataclasses.replace(MODEL, params_dtype=PUSH_DTYPE)
    meta = to_hf({s.name: torch.empty(s.shape, device="meta") for s in describe(model)}, model)
    zeros = {name: torch.zeros(t.shape, dtype=model.torch_dtype) for name, t in meta.items()}
    path = tmp_path / "weights.pt"
    torch.save(zeros, path)
    # Over NCCL the fake receives on its own GPU (the second; the trainer holds the first).
    gpu = (("CUDA_VISIBLE_DEVICES", "1"),) if backend == "nccl" else ()
    server_config = SGLangServerConfig(
        model_path="fake", module="dynarl.testing.sglang_fake",
        extra_args=("--fake-weights", str(path)), health_poll_s=0.05, startup_timeout_s=120,
        env=gpu,
    )  # fmt: skip
    trainer = MegatronTrainer(model, MegatronTrainConfig(device="cuda"), rank=0, store=solo)

    async def main() -> tuple[str, str, Any]:
        async with (
            SGLangServer(server_config) as server,
            SGLangServerEngine(url=server.url) as engine,
        ):
            before = await engine.weight_version()
            targets = [EngineTarget("sglang", server.url)]
            await push_to_engines(trainer, targets, VERSION, backend=backend)
            return before, await engine.weight_version(), await engine.client.weights_checksum()

    try:
        trainer.start(trainer.layout_spec((0,)), epoch=0)
        trainer.train_step(batch(0))
        before, after, reply = asyncio.run(main())
        pushed = {n: t.cpu() for n, t in to_hf(trainer.gather(0), model).items()}
    finally:
        trainer.close()
    assert (before, after) == ("default", VERSION)
    groups = model.query_groups
    expected = expected_checksums(pushed, num_key_value_heads=groups)
    assert checksum_mismatches(reply, expected) == []
    assert reply.per_engine_checksum == expected.per_engine
    assert expected.per_engine != expected_checksums(zeros, num_key_value_heads=groups).per_engine
