"""The Megatron trainer role's parts in one process: its setup option, the samples it
reads, the gradient rows of a streamed step, and a streamed step against a whole-batch one."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dynarl.backends._grpo import GRPOConfig, TrainSample
from dynarl.backends.megatron import (
    GPTModelConfig,
    MegatronSetup,
    MegatronTrainConfig,
    MegatronTrainer,
    MegatronTrainerRole,
    hf_config,
)
from dynarl.backends.megatron._grad_rows import GradientRows, grad_buffers
from dynarl.backends.megatron._samples import micro_batches, train_sample
from dynarl.backends.reference import solo_process_group
from dynarl.bus import Sample, pack_floats, pack_tokens
from dynarl.errors import BackendError

# Megatron 0.16.1's RowParallelLinear warns on rank 0 at every forward: third-party noise.
pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")

MODEL = GPTModelConfig(
    num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=48, vocab_size=64, max_sequence_length=32, init_seed=3,
)  # fmt: skip
CPU = MegatronTrainConfig(lr=1e-2, micro_batch_size=2, clip_grad=0.5, device="cpu")


@pytest.fixture
def solo() -> Iterator[Any]:
    """A one-rank job and its store; every process group built in the test must be gone."""
    with solo_process_group():
        yield dist.HashStore()  # type: ignore[attr-defined]
    assert not c10d._world.pg_map, f"leaked process groups: {list(c10d._world.pg_names.values())}"


def sample(sid: str, tokens: list[int], prompt_len: int, **metadata: Any) -> Sample:
    return Sample(
        sample_id=sid, token_ids=pack_tokens(tokens), prompt_len=prompt_len, metadata=metadata
    )


def test_setup_travels_as_an_option_and_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    setup = MegatronSetup(model=MODEL, train=CPU, tp=1, num_threads=1)
    assert MegatronSetup.from_options(setup.to_options()) == setup
    with pytest.raises(ValueError, match="lack"):
        MegatronSetup.from_options({})
    with_kl = MegatronSetup(
        model=MODEL, train=dataclasses.replace(CPU, grpo=GRPOConfig(kl_coef=0.1))
    )
    assert MegatronSetup.from_options(with_kl.to_options()) == with_kl
    with pytest.raises(ValueError, match="tp >= 1"):
        MegatronSetup(model=MODEL, tp=0)
    with pytest.raises(ValueError, match="do not split"):
        MegatronSetup(model=MODEL, tp=2).layout_spec((0, 1, 2))
    spec = MegatronSetup(model=MODEL, tp=2).layout_spec((0, 1, 2, 3))
    assert (spec.tp, spec.pp, spec.dp, spec.master_dtype) == (2, 1, 2, None)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(MODEL)))
    from_hf = MegatronSetup.from_hf(tmp_path, train=CPU)
    assert from_hf.hf_path == str(tmp_path) and from_hf.model.vocab_size == MODEL.vocab_size


def test_role_layout_is_the_one_the_trainer_builds(solo: Any) -> None:
    setup = MegatronSetup(model=MODEL, train=CPU)
    one = MegatronTrainer(MODEL, CPU, rank=0, store=solo)
    try:
        for devices in ((0,), (0, 1), (1, 2, 3)):
            planned = MegatronTrainerRole.plan_layout(setup.to_options(), devices)
            assert planned == one.layout_for(one.layout_spec(devices, dp=len(devices)))
    finally:
        one.close()


def test_samples_group_into_ordered_micro_batches_with_masks_and_old_logprobs() -> None:
    a = sample("b", [1, 2, 3, 4, 5, 6], 2, group=1, seed_id=1, advantage=0.5, env="1:3")
    b = sample("a", [1, 2, 3, 4], 2, group=1, seed_id=0)
    c = sample("c", [7, 8, 9], 1, group=0)
    assert micro_batches([a, c, b]) == {0: [c], 1: [b, a]}
    with pytest.raises(ValueError, match="micro-batch"):
        micro_batches([sample("x", [1, 2], 1)])
    converted = train_sample(a)
    assert converted.loss_mask == (False, True, False, False, True)
    assert converted.advantage == 0.5 and converted.old_logprobs is None
    rollout = msgspec.structs.replace(a, logprobs=pack_floats([-1.0, -2.0]))
    # Two policy tokens (positions 0 and 3 of the response) take the two log-probs.
    assert train_sample(rollout, old="rollout").old_logprobs == (0.0, -1.0, 0.0, 0.0, -2.0)
    with pytest.raises(ValueError, match="prompt"):
        train_sample(sample("p", [1, 2], 2))


def test_gradient_rows_sum_in_micro_batch_order_and_refuse_gaps() -> None:
    rows = [torch.tensor([1e8, 1.0, -0.0]), torch.tensor([-1e8, 1.0, -0.0]), torch.ones(3)]
    book, other = GradientRows(), GradientRows()
    for index in (2, 0, 1):
        book.add(index, rows[index])
    for index in (0, 1, 2):
        other.add(index, rows[index])
    total = book.total(3, row_size=3, group=None)
    assert torch.equal(total, ((rows[0] + rows[1]) + rows[2]))
    assert torch.equal(total, other.total(3, row_size=3, group=None))
    with pytest.raises(ValueError, match="already"):
        book.add(1, rows[1])
    with pytest.raises(BackendError, match="missing or repeated \\[3\\]"):
        book.total(4, row_size=3, group=None)
    with pytest.raises(BackendError, match="1 rows beyond"):
        book.total(2, row_size=3, group=None)


def batch(seed: int) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(5):
        tokens = torch.randint(0, MODEL.vocab_size, (7 + i,), generator=gen).tolist()
        out.append(
            TrainSample(
                tokens=tuple(tokens),
                loss_mask=tuple([False] * 2 + [True] * (4 + i)),
                advantage=(i % 3) - 1.0,
            )
        )
    return out


def whole_ddp(trainer: MegatronTrainer) -> Any:
    """The trainer's Megatron DDP module (test access to its gradient buffers)."""
    return trainer._require().ddp


@pytest.mark.gloo_listener_outlives_test
def test_a_streamed_step_is_the_whole_batch_step(solo: Any) -> None:
    streamed = MegatronTrainer(MODEL, CPU, rank=0, store=solo)
    whole = MegatronTrainer(MODEL, CPU, rank=0, store=solo)
    try:
        streamed.start(streamed.layout_spec((0,)), epoch=0)
        whole.start(whole.layout_spec((0,)), epoch=1)
        assert streamed.state_checksum() == whole.state_checksum()
        samples = batch(1)
        book = GradientRows()
        for index, start in enumerate(range(0, len(samples), 2)):
            book.add(index, streamed.micro_gradient(samples[start : start + 2]))
        total = book.total(len(book), row_size=streamed.row_size, group=None)
        mine = streamed.apply_gradient(total, num_samples=len(samples))
        theirs = whole.train_step(samples)
        assert (mine.version, mine.num_tokens) == (theirs.version, theirs.num_tokens)
        assert mine.loss == pytest.approx(theirs.loss, rel=1e-5)
        assert mine.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-5)
        # The gradient the streamed step applied is the one DDP reduced (still in its
        # buffers after train_step). Parameters are not compared: Adam's first step turns
        # float-noise differences of near-zero gradients into differences of size lr.
        reduced = torch.cat([b.grad_data.reshape(-1) for b in grad_buffers(whole_ddp(whole))])
        torch.testing.assert_close(total[:-4] / total[-1], reduced, rtol=1e-5, atol=1e-8)
        assert reduced.abs().max() > 1e-3
        with pytest.raises(ValueError, match="row has shape"):
            streamed.apply_gradient(total[:-1], num_samples=1)
    finally:
        streamed.close()
        whole.close()


def test_push_targets_come_from_the_rollouts_addresses_or_are_refused() -> None:
    from dynarl.backends.megatron import EngineTarget, engine_targets
    from dynarl.backends.megatron._role import engine_targets_of
    from dynarl.runtime import CallResult

    addresses = [
        CallResult(device=3, values={"kind": "sglang", "url": "http://h:2", "name": "b"}),
        CallResult(device=1, values={"kind": "vllm", "url": "http://h:1", "name": "a"}),
    ]
    assert engine_targets_of(engine_targets(addresses)) == [
        EngineTarget("vllm", "http://h:1"),
        EngineTarget("sglang", "http://h:2"),
    ]
    in_process = [CallResult(device=0, values={"kind": "vllm", "url": "", "name": "x"})]
    for bad, why in (
        (engine_targets(in_process), "http"),
        ("[]", "no engines"),
        ("{", "engine_targets' JSON list"),
        ('[{"kind": "tgi", "url": "http://h"}]', "'vllm' or 'sglang'"),
    ):
        with pytest.raises(ValueError, match=why):
            engine_targets_of(bad)
