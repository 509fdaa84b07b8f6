"""Checkpoints: round trips, verification, atomic publication, retention, RNG states,
restores into another layout, and a resumed job that continues the same sample stream."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dynarl.errors import IntegrityError
from dynarl.migrate import Layout, LayoutSpec, ParamSpec, Stage, trainer_layout
from dynarl.runtime.durable._checkpoint import MANIFEST, CheckpointRef, CheckpointStore
from dynarl.runtime.durable._journal import Journal, recover
from dynarl.runtime.durable._manifest import Manifest
from dynarl.runtime.durable._rng import capture_rng, restore_rng
from dynarl.runtime.durable._source import SampleSource, SourceConfig


def some_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=generator),
        "half": torch.randn(7, generator=generator).to(torch.bfloat16),
        "step": torch.tensor(12.0),
        "ids": torch.arange(10, dtype=torch.int64).reshape(2, 5)[:, ::2],  # non-contiguous
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
    }


def test_a_checkpoint_round_trips_tensors_cursor_version_and_metadata(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    tensors = some_tensors()
    ref = store.save(
        steps_done=4, version=9, cursor=128, shards={0: tensors, 1: {"w": tensors["w"] + 1}},
        metadata={"lr": 1e-3, "name": "toy"},
    )  # fmt: skip
    assert store.latest() == ref and (ref.steps_done, ref.version, ref.cursor) == (4, 9, 128)
    manifest = store.manifest(ref)
    assert manifest.metadata == {"lr": 1e-3, "name": "toy"} and manifest.layout is None
    back = store.read_shard(ref, 0)
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert torch.equal(store.read_shard(ref, 1, ["w"])["w"], tensors["w"] + 1)
    with pytest.raises(ValueError, match="no shard of rank 2"):
        store.read_shard(ref, 2)


def test_damaged_checkpoints_are_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    ref = store.save(steps_done=1, version=1, cursor=0, shards={0: some_tensors()})
    shard = Path(ref.path) / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="'w' fails its checksum"):
        store.read_shard(ref, 0)
    assert torch.equal(store.read_shard(ref, 0, ["step"])["step"], torch.tensor(12.0))
    forged = CheckpointRef(path=ref.path, steps_done=1, version=1, cursor=0, digest="0" * 64)
    with pytest.raises(IntegrityError, match="does not match its digest"):
        store.manifest(forged)
    (Path(ref.path) / MANIFEST).unlink()
    with pytest.raises(IntegrityError, match="no readable manifest"):
        store.manifest(ref)
    assert store.latest() is None


def test_only_published_checkpoints_exist_and_old_ones_are_pruned(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, num_keep=2)
    refs = [
        store.save(steps_done=s, version=s, cursor=10 * s, shards={0: {"x": torch.ones(2) * s}})
        for s in range(4)
    ]
    assert store.checkpoints() == refs[2:]
    # A save that crashed before publishing: shards but no manifest.
    unfinished = store.begin(5)
    store.write_shard(unfinished, 0, {"x": torch.zeros(2)})
    assert store.latest() == refs[3]
    stale = store.begin(1)
    assert store.prune() == [stale]  # older than the newest checkpoint: abandoned
    assert unfinished.exists()  # newer: maybe still being written
    survivors = store.save(steps_done=5, version=5, cursor=50, shards={0: {"x": torch.ones(2)}})
    assert [r.steps_done for r in store.checkpoints()] == [3, 5]
    assert not unfinished.exists() and Path(survivors.path).exists()
    with pytest.raises(ValueError, match="num_keep"):
        CheckpointStore(tmp_path, num_keep=0)


def test_publish_refuses_inconsistent_shards(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    directory = store.begin(0)
    record = store.write_shard(directory, 0, {"x": torch.ones(3)})
    with pytest.raises(ValueError, match="two shards claim one rank"):
        store.publish(directory, steps_done=0, version=0, cursor=0, shards=[record, record])
    (directory / record.file).write_bytes(b"short")
    with pytest.raises(ValueError, match="holds 5 bytes"):
        store.publish(directory, steps_done=0, version=0, cursor=0, shards=[record])
    assert store.latest() is None


def test_rng_states_come_back(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leaves a cached Gaussian in NumPy's state
    store = CheckpointStore(tmp_path)
    ref = store.save(steps_done=0, version=0, cursor=0, shards={0: {}}, rng={0: capture_rng()})
    expected = (random.random(), np.random.normal(), torch.rand(4))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    state = store.manifest(ref).shard(0).rng
    assert state is not None
    restore_rng(state)
    again = (random.random(), np.random.normal(), torch.rand(4))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])


# ---------------------------------------------------------------- restore into another layout

PARAMS = [
    ParamSpec(name="embedding", shape=(8, 4), tp_dim=0, stage=Stage.FIRST),
    ParamSpec(name="layers.0.fc1", shape=(8, 4), tp_dim=0, stage=Stage.LAYER, layer=0),
    ParamSpec(name="layers.0.fc2", shape=(4, 8), tp_dim=1, stage=Stage.LAYER, layer=0),
    ParamSpec(name="layers.1.fc1", shape=(8, 4), tp_dim=0, stage=Stage.LAYER, layer=1),
    ParamSpec(name="head.bias", shape=(6,), stage=Stage.LAST),
]


def full_state(layout: Layout) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {t.name: torch.randn(t.shape, generator=generator) for t in layout.tensors}


def local_tensors(
    full: dict[str, torch.Tensor], layout: Layout, rank: int
) -> dict[str, torch.Tensor]:
    out = {n: torch.zeros(s) for n, s in layout.local_shapes_on(rank).items()}
    for placement in layout.placements_on(rank):
        shard = placement.shard
        placement.view(out[shard.tensor]).copy_(full[shard.tensor][shard.region.slices() or ...])
    return out


@pytest.mark.parametrize(
    ("saved", "target"),
    [
        (LayoutSpec(ranks=(0, 1), tp=2), LayoutSpec(ranks=(0,))),
        (LayoutSpec(ranks=(0, 1, 2, 3), tp=2, dp=2, distributed_optimizer=True),
         LayoutSpec(ranks=(0, 1), pp=2)),
        (LayoutSpec(ranks=(0,)), LayoutSpec(ranks=(3, 1, 2, 0), tp=2, dp=2,
                                            distributed_optimizer=True)),
    ],
)  # fmt: skip
def test_a_checkpoint_restores_into_another_layout(
    tmp_path: Path, saved: LayoutSpec, target: LayoutSpec
) -> None:
    src, dst = trainer_layout(PARAMS, saved), trainer_layout(PARAMS, target)
    full = full_state(src)
    store = CheckpointStore(tmp_path)
    shards = {rank: local_tensors(full, src, rank) for rank in src.ranks}
    ref = store.save(steps_done=2, version=2, cursor=16, shards=shards, layout=src)
    for rank in dst.ranks:
        restored = store.restore(ref, dst, rank)
        expected = local_tensors(full, dst, rank)
        assert restored.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(restored[name], tensor), (rank, name)


def test_restore_refuses_other_tensors(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    plain = store.save(steps_done=0, version=0, cursor=0, shards={0: {"x": torch.ones(1)}})
    layout = trainer_layout(PARAMS, LayoutSpec(ranks=(0,)))
    with pytest.raises(ValueError, match="has no layout"):
        store.restore(plain, layout, 0)
    other = trainer_layout(PARAMS[:2], LayoutSpec(ranks=(0,)))
    ref = store.save(
        steps_done=1, version=0, cursor=0, shards={0: local_tensors(full_state(other), other, 0)},
        layout=other,
    )  # fmt: skip
    with pytest.raises(ValueError, match="differs from the checkpoint"):
        store.restore(ref, layout, 0)


# ---------------------------------------------------------------- a resumed job


class ToyJob:
    """A tiny trainer whose every step uses samples, dropout and all three RNGs."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.05)
        self.source = SampleSource(SourceConfig(seed=11, num_items=7, group_size=2))
        self.manifest = Manifest()

    def step(self, step: int) -> None:
        tickets = self.source.take(4)
        for ticket in tickets:
            self.manifest.issue(ticket.sample_id, step)
            attempt = self.manifest.dispatch(ticket.sample_id)
            self.manifest.generated(ticket.sample_id, attempt, num_tokens=1)
            self.manifest.scored(ticket.sample_id)
        inputs = torch.tensor([[t.item, t.member, t.seed % 97, random.random()] for t in tickets])
        noise = torch.from_numpy(np.random.normal(size=(4, 8)).astype(np.float32))
        loss = ((self.model(inputs) - noise) ** 2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.manifest.trained(step, [t.sample_id for t in tickets])

    def state(self) -> dict[str, torch.Tensor]:
        tensors = {f"param/{n}": p.detach().clone() for n, p in self.model.named_parameters()}
        for index, param in enumerate(self.model.parameters()):
            for key, value in self.optimizer.state[param].items():
                tensors[f"adam/{index}/{key}"] = value.clone()
        return tensors

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(tensors[f"param/{name}"])
        for index, param in enumerate(self.model.parameters()):
            keys = ("step", "exp_avg", "exp_avg_sq")
            self.optimizer.state[param] = {k: tensors[f"adam/{index}/{k}"].clone() for k in keys}


def test_a_resumed_job_continues_the_same_sample_stream_bit_for_bit(tmp_path: Path) -> None:
    straight = ToyJob(seed=3)
    digests = []
    for step in range(6):
        straight.step(step)
        digests.append(straight.manifest.close_step(step).digest)

    first = ToyJob(seed=3)
    store = CheckpointStore(tmp_path / "ckpt")
    with Journal(tmp_path / "journal") as journal:
        for step in range(3):
            first.step(step)
            closed = first.manifest.close_step(step)
            journal.complete_step(step, cursor=first.source.cursor, digest=closed.digest)
        ref = store.save(
            steps_done=3, version=3, cursor=first.source.cursor, shards={0: first.state()},
            rng={0: capture_rng()},
        )  # fmt: skip
        journal.record_checkpoint(
            steps_done=3, path=ref.path, version=3, cursor=ref.cursor, digest=ref.digest
        )
        first.step(3)  # done, then lost with the process: it is redone after the restore
        lost = first.manifest.close_step(3).digest
        journal.complete_step(3, cursor=first.source.cursor, digest=lost)

    state = recover(tmp_path / "journal")  # a new process: fresh objects, other seeds
    assert state.checkpoint is not None and state.steps_done == 4
    resumed = ToyJob(seed=99)
    ref = CheckpointRef.from_record(state.checkpoint)
    resumed.load(store.read_shard(ref, 0))
    rng = store.manifest(ref).shard(0).rng
    assert rng is not None
    restore_rng(rng)
    resumed.source.seek(ref.cursor)
    for step, digest in state.digests:
        resumed.manifest.expect(step, digest)
    for step in range(ref.steps_done, 6):
        resumed.step(step)
        assert resumed.manifest.close_step(step).digest == digests[step]
    assert resumed.manifest.report().ok
    for name, tensor in straight.state().items():
        assert torch.equal(resumed.state()[name], tensor), name
