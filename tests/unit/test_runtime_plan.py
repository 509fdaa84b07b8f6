"""The coordinator's pure planning, the cost model, options and the worker protocol."""

from __future__ import annotations

import msgpack
import pytest

from dynarl.bus import Envelope, Sample, pack_tokens
from dynarl.errors import ProtocolError
from dynarl.migrate import plan_reshard
from dynarl.runtime import ComponentSpec
from dynarl.runtime._worker_protocol import (
    PROTOCOL,
    Activate,
    Call,
    CallResult,
    Reshard,
    pack,
    unpack,
)
from dynarl.runtime.controller._coordinator import plan_moves
from dynarl.runtime.controller._planner_cost import PlannerCost
from dynarl.runtime.worker._options import WorkerOptions
from dynarl.sched import DeviceMove, MigrationCommand, Resize
from dynarl.testing import ScriptedRollout, ShadowTrainer, TinyTrainer
from dynarl.types import Allocation, MigrationKind

SPECS = {
    spec.name: spec
    for spec in (
        ComponentSpec(role=ScriptedRollout, devices=(0, 1)),
        ComponentSpec(role=TinyTrainer, devices=(2,)),
        ComponentSpec(role=ShadowTrainer, devices=(3,), migration=MigrationKind.REBOOT),
    )
}


def command(old: dict[str, list[int]], new: dict[str, list[int]]) -> MigrationCommand:
    return MigrationCommand(
        decision_id="d1",
        time=0.0,
        old_allocation=Allocation.of(old),
        new_allocation=Allocation.of(new),
        moves=(DeviceMove(src=None, dst=None, devices=()),),
    )


def test_each_component_moves_by_its_kind_and_donors_go_first() -> None:
    moves = plan_moves(
        command(
            {"rollout": [0, 1], "trainer": [2], "shadow": [3]},
            {"rollout": [0], "trainer": [1, 2], "shadow": [3]},
        ),
        SPECS,
        {},
    )
    assert [(m.component, m.kind, m.removed, m.added) for m in moves] == [
        ("rollout", MigrationKind.WORKLOAD, (1,), ()),
        ("trainer", MigrationKind.P2P, (), (1,)),
    ]
    moves = plan_moves(
        command(
            {"rollout": [0], "trainer": [1, 2], "shadow": [3]},
            {"rollout": [0], "trainer": [2], "shadow": [1, 3]},
        ),
        SPECS,
        {},
    )
    assert [(m.component, m.kind) for m in moves] == [
        ("trainer", MigrationKind.P2P),
        ("shadow", MigrationKind.REBOOT),
    ]


def test_a_stateful_component_sleeps_in_place_and_wakes_only_there() -> None:
    (away,) = plan_moves(command({"trainer": [0, 1]}, {"trainer": []}), SPECS, {})
    assert (away.kind, away.in_place, away.removed) == (MigrationKind.REBOOT, True, (0, 1))
    (back,) = plan_moves(command({"trainer": []}, {"trainer": [0, 1]}), SPECS, {"trainer": (0, 1)})
    assert (back.kind, back.in_place, back.added) == (MigrationKind.REBOOT, True, (0, 1))
    with pytest.raises(ValueError, match="it can only wake there"):
        plan_moves(command({"trainer": []}, {"trainer": [2]}), SPECS, {"trainer": (0, 1)})
    with pytest.raises(ValueError, match="unknown component"):
        plan_moves(command({"mystery": [0]}, {"mystery": [1]}), SPECS, {})
    (serving,) = plan_moves(command({"rollout": [0, 1]}, {"rollout": []}), SPECS, {})
    assert (serving.kind, serving.in_place) == (MigrationKind.WORKLOAD, False)


def test_the_cost_of_a_p2p_resize_is_the_planned_bytes() -> None:
    layout = SPECS["trainer"].plan_layout()
    assert layout is not None
    cost = PlannerCost({"trainer": layout}, bytes_per_s=1e6)
    grow = Resize(component="trainer", migration=MigrationKind.P2P, old_devices=1, new_devices=2)
    src, dst = layout((0,)), layout((0, 1))
    expected = plan_reshard(dst.tensor_map(), src.shards, dst.shards).bytes_moved
    assert expected > 0 and cost.resize_bytes(grow) == expected
    shrink = Resize(
        component="rollout", migration=MigrationKind.WORKLOAD, old_devices=2, new_devices=1
    )
    estimate = cost.estimate((grow, shrink))
    assert estimate.bytes == expected
    assert estimate.seconds == pytest.approx(max(1.0, 1.0 + expected / 1e6))
    cost.observe(MigrationKind.P2P, nbytes=10_000_000, seconds=3.0)
    assert cost.bytes_per_s > 1e6


def test_worker_options_survive_the_command_line_and_take_the_torchrun_rank() -> None:
    options = WorkerOptions(
        controller="tcp://127.0.0.1:5", device=3, store_port=7, preload=("a.b",)
    )
    assert WorkerOptions.from_args(options.to_args()) == options
    env = {"RANK": "2", "WORLD_SIZE": "4", "DYNARL_CONTROLLER": "tcp://h:1", "DYNARL_STORE": "h:9"}
    parsed = WorkerOptions.from_args([], env)
    assert (parsed.device, parsed.controller, parsed.store_host, parsed.store_port) == (
        2,
        "tcp://h:1",
        "h",
        9,
    )
    with pytest.raises(ValueError, match="store address"):
        WorkerOptions.from_args(["--controller=x", "--device=0", "--store=nope"])


def test_runtime_messages_travel_in_an_envelope_plain_msgpack_can_read() -> None:
    sample = Sample(sample_id="s", token_ids=pack_tokens([1, 2]), prompt_len=1)
    messages = [
        Activate(component="c", role="m:C", devices=(0, 1), options={"x": 1}),
        Call(component="c", method="m", samples=(sample,), options={"lr": 0.5}),
        CallResult(device=1, values={"checksum": "ab"}),
        Reshard(migration_id="m", step="prepare", src=(0,), dst=(0, 1), epoch=3),
    ]
    for message in messages:
        envelope = pack(message)
        assert envelope.protocol == PROTOCOL
        assert msgpack.unpackb(envelope.body)["type"] == type(message).__name__
        assert unpack(envelope) == message
    with pytest.raises(ProtocolError, match="protocol"):
        unpack(Envelope(protocol="other/1", body=b""))
    with pytest.raises(ProtocolError):
        unpack(Envelope(protocol=PROTOCOL, body=msgpack.packb({"type": "Nope"})))
