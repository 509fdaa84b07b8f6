"""The mixture-of-experts workload (Qwen3-30B-A3B): its derivation from the stated facts,
its expert-parallel reshard bytes, and a trainer limited to reboots."""

from __future__ import annotations

import functools
import importlib
import itertools
import math
import sys
import tomllib
from types import ModuleType

import pytest
from sim_support import WORKLOADS

from dynarl.sched import Resize
from dynarl.sim import MigrationSpec, Workload, load_workload, run_policy, with_overrides
from dynarl.sim._components import ModelledMigrationCost, build_nodes, migration_bytes
from dynarl.sim._workload_file import workload_from_dict
from dynarl.types import MigrationKind

PATH = WORKLOADS / "moe" / "math-qwen3-30b-a3b-64gpu.toml"


@functools.cache
def _moe() -> ModuleType:
    if str(WORKLOADS) not in sys.path:
        sys.path.insert(0, str(WORKLOADS))  # moe_qwen3 imports calibrate beside it
    return importlib.import_module("moe_qwen3")


@functools.cache
def _moved() -> tuple[int, int]:
    return _moe().reshard_bytes()  # type: ignore[no-any-return]


def _workload() -> Workload:
    return load_workload(PATH)


def test_the_file_is_what_the_derivation_gives() -> None:
    moe = _moe()
    moved = _moved()
    assert moe.render(moe.derive(moved), moved) == PATH.read_text(encoding="utf-8")
    assert _workload() == moe.derive(moved)
    lines = PATH.read_text(encoding="utf-8").splitlines()
    for above, line in itertools.pairwise(lines):
        if " = " in line and not line.startswith("#"):
            assert above.startswith("#"), f"{line!r} has no source above it"


def test_the_model_follows_its_published_facts() -> None:
    moe, w = _moe(), _workload()
    q1 = moe.MOE_FACTS["Q1"][0]
    total, active = moe.MOE_FACTS["Q2"][0]
    counted = moe.activated_params()
    assert w.model.num_params == pytest.approx(total, rel=0.002)
    assert counted == pytest.approx(active, rel=0.02)
    assert counted / w.model.num_params == pytest.approx(active / total, rel=0.02)
    # The experts it skips: 120 of 128 in each of 48 layers, 3 x hidden x expert_ffn each.
    per_expert = 3 * q1["hidden"] * q1["expert_ffn"]
    skipped = (q1["experts"] - q1["top_k"]) * q1["layers"] * per_expert
    assert w.model.num_params - counted == skipped
    assert w.model.kv_bytes_per_token == 2 * q1["layers"] * q1["kv_heads"] * q1["head_dim"] * 2
    assert (w.model.num_layers, w.model.hidden_size) == (q1["layers"], q1["hidden"])


def test_decode_reads_every_weight_and_computes_on_the_activated_ones() -> None:
    moe, w = _moe(), _workload()
    calibrate = sys.modules["calibrate"]
    ro, active = w.rollout, moe.activated_params()
    bw = ro.tp * calibrate.HBM_BPS * 0.7
    overhead = calibrate.FITTED["step_overhead_s"] + 2 * w.model.num_layers * 8e-6
    assert (ro.step_fixed_s - overhead) * bw == pytest.approx(2 * w.model.num_params)
    assert ro.step_per_seq_s == pytest.approx(2 * active / (ro.tp * calibrate.PEAK_FLOPS * 0.5))
    assert ro.prefill_tokens_per_s * 2 * active == pytest.approx(ro.tp * calibrate.PEAK_FLOPS / 2)
    # B4: TP 2 leaves under F8's 100 GB for the KV cache, TP 4 holds it.
    free = [tp * 80 * (1 << 30) * 0.85 - 2 * w.model.num_params for tp in (2, 4)]
    assert free[0] < 100e9 <= free[1] and ro.tp == 4
    assert ro.kv_capacity_tokens == int(100e9 // w.model.kv_bytes_per_token)


def test_the_trainer_follows_its_layout_and_measured_throughput() -> None:
    moe, w = _moe(), _workload()
    calibrate = sys.modules["calibrate"]
    layout = moe.MOE_FACTS["Q3"][0]
    unit = math.lcm(layout["tp"] * layout["pp"], layout["etp"] * layout["ep"] * layout["pp"])
    assert w.trainer.tp == w.inference.tp == unit == 8
    assert w.trainer.min_gpus == 16 and w.trainer.parkable
    active = moe.activated_params()
    width = 32 * 128
    pretrain = 6 * active + 12 * 48 * width * 2048  # A8's count at 4,096 tokens (B3, B6)
    mfu = moe.MOE_FACTS["Q4"][0] * pretrain / calibrate.PEAK_FLOPS
    _, ctx = calibrate._context(w.lengths)
    update = 6 * active + 12 * 48 * width * ctx
    rl = calibrate.PEAK_FLOPS * mfu * 0.25 / 0.40 / update
    assert w.trainer.tokens_per_s_per_gpu == pytest.approx(rl)
    forward = 2 * active + 4 * 48 * width * ctx
    assert w.inference.tokens_per_s_per_gpu * forward == pytest.approx(rl * update * 1.4)


def test_the_ep_reshard_moves_what_the_stated_sizes_say() -> None:
    """B7's busiest receiver (a new GPU) gets its experts' and its TP shard's bf16 weights
    whole and a third (EDP 3) or a sixth (DP 6) of their fp32 master and Adam moments."""
    moe, w = _moe(), _workload()
    q1 = moe.MOE_FACTS["Q1"][0]
    experts = q1["layers"] * q1["experts"] * 3 * q1["hidden"] * q1["expert_ffn"]
    dense = w.model.num_params - experts
    moe_bytes, dense_bytes = _moved()
    assert moe_bytes == pytest.approx(
        experts / 8 * (2 + 12 / 3) + dense / 4 * (2 + 12 / 6), rel=2e-3
    )
    dense32b = moe.count(moe.dense32b_params(moe.MOE_FACTS["Q5"][0]["layers"]))
    assert dense32b == pytest.approx(32.8e9, rel=0.002)  # M1
    assert dense_bytes == pytest.approx(dense32b / 8 * (2 + 12 / 3), rel=2e-3)
    assert w.migration.p2p_s == round(2.8 * moe_bytes / dense_bytes, 3)
    assert w.migration.reboot_s == pytest.approx(30 + 2 * w.model.num_params / 2e9, abs=1e-3)


def test_a_reboot_only_trainer_restarts_on_every_resize_but_a_park() -> None:
    w = with_overrides(_workload(), {"migration.trainer_kind": "reboot"})
    assert build_nodes(w)["trainer"].migration is MigrationKind.REBOOT
    reboot = ModelledMigrationCost(spec=w.migration, sharded_state_fraction=0.75)
    p2p = ModelledMigrationCost(spec=_workload().migration, sharded_state_fraction=0.75)

    def resize(kind: MigrationKind, old: int, new: int) -> Resize:
        return Resize(
            component="trainer",
            migration=kind,
            old_devices=old,
            new_devices=new,
            tp=8,
            state_bytes=w.model.state_bytes,
        )

    for old, new in ((16, 24), (24, 16), (0, 16)):
        assert reboot.resize_seconds(resize(MigrationKind.REBOOT, old, new)) == w.migration.reboot_s
    assert p2p.resize_seconds(resize(MigrationKind.P2P, 16, 24)) == w.migration.p2p_s
    park = p2p.resize_seconds(resize(MigrationKind.P2P, 16, 0))
    assert reboot.resize_seconds(resize(MigrationKind.REBOOT, 16, 0)) == park < 1.0
    # A reboot saves what the old GPUs hold and loads what the new ones hold.
    state, f = w.model.state_bytes, w.model.sharded_state_fraction
    held = {n: state * (1 - f) * n / 8 + state * f for n in (16, 24)}
    assert migration_bytes(w, "trainer", 16, 24) == pytest.approx(held[16] + held[24], abs=2)
    assert migration_bytes(w, "trainer", 16, 24) > migration_bytes(_workload(), "trainer", 16, 24)


def test_reboot_only_is_not_faster_than_an_ep_reshard() -> None:
    # Half the batch and one iteration, to keep the test short; the full table
    # (docs/workloads.md) is examples/workloads/moe_table.py's.
    changes = {"batch.num_prompts": 256, "num_iterations": 1, "num_warmup_iterations": 0}
    small = with_overrides(_workload(), changes)
    p2p = run_policy(small, "dynarl")
    reboot = run_policy(with_overrides(small, {"migration.trainer_kind": "reboot"}), "dynarl")
    assert p2p.iteration_s < reboot.iteration_s
    assert p2p.migration_share < reboot.migration_share


def test_a_bad_trainer_kind_names_its_key() -> None:
    with pytest.raises(ValueError, match=r"MigrationSpec\.trainer_kind = 'scp' must be"):
        MigrationSpec(
            workload_s=1.0,
            p2p_s=1.0,
            reboot_s=1.0,
            weight_sync_s=1.0,
            phase_switch_s=1.0,
            trainer_kind="scp",  # type: ignore[arg-type]
        )
    data = tomllib.loads(PATH.read_text(encoding="utf-8"))
    data["migration"]["trainer_kind"] = "scp"
    with pytest.raises(ValueError, match=r"\[migration\] trainer_kind = 'scp' must be one of"):
        workload_from_dict(data)
    with pytest.raises(ValueError, match=r"\[migration\] trainer_kind = 'scp' must be one of"):
        with_overrides(_workload(), {"migration.trainer_kind": "scp"})
