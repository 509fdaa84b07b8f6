"""A worker's roles: one active at a time, asleep with their state, torn down; shard files."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import pytest
import torch

from dynarl.bus import WorkerGroup
from dynarl.bus._channel import ChannelTable
from dynarl.errors import WorkerError
from dynarl.runtime import RoleContext
from dynarl.runtime._worker_protocol import Activate
from dynarl.runtime.durable._shardfile import load_shards, save_shards
from dynarl.runtime.worker._host import RoleHost
from dynarl.runtime.worker._role import ComputeThread, role_path
from dynarl.testing import TinyState, TinyTrainer
from dynarl.types import ComponentKind

EVENTS: list[str] = []


class Sleepy(WorkerGroup, kind=ComponentKind.INFERENCE, name="sleepy"):
    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.ticks = 0
        EVENTS.append(f"{ctx.component}:init")

    async def start(self) -> None:
        self.weights = await self.ctx.compute(lambda: [1.0, 2.0])
        EVENTS.append("sleepy:start")

    async def run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0.001)

    async def sleep(self) -> None:
        EVENTS.append("sleepy:sleep")

    async def wake(self) -> None:
        EVENTS.append("sleepy:wake")

    async def close(self) -> None:
        EVENTS.append("sleepy:close")


class Other(WorkerGroup, kind=ComponentKind.TOOL, name="other"):
    def __init__(self, ctx: RoleContext) -> None:
        EVENTS.append("other:init")


def activate(cls: type[WorkerGroup], *, fresh: bool = True) -> Activate:
    return Activate(component=cls.spec.name, role=role_path(cls), devices=(0,), fresh=fresh)


def test_one_role_is_active_and_the_others_sleep_with_their_state() -> None:
    EVENTS.clear()

    async def main() -> None:
        compute = ComputeThread()

        def context(command: Activate) -> RoleContext:
            return RoleContext(
                component=command.component,
                device=0,
                devices=command.devices,
                options=command.options,
                epoch=command.epoch,
                compute=compute,
                store=lambda: pytest.fail("no store in this test"),
                backend=ChannelTable(),
            )

        async with asyncio.TaskGroup() as group:
            host = RoleHost(0, group, context)
            await host.activate(activate(Sleepy))
            sleepy = host.role("sleepy")
            assert isinstance(sleepy, Sleepy) and sleepy.weights == [1.0, 2.0]
            await asyncio.sleep(0.02)
            assert sleepy.ticks > 0
            status = await host.activate(activate(Other))
            assert (status.active, status.asleep) == ("other", ("sleepy",))
            ticks = sleepy.ticks
            await asyncio.sleep(0.02)
            assert sleepy.ticks == ticks  # asleep: its loop no longer runs
            await host.activate(activate(Sleepy))
            assert host.role("sleepy") is sleepy and host.active == "sleepy"
            await host.deactivate("sleepy", keep=False)
            with pytest.raises(WorkerError):
                host.role("sleepy")
            await host.adopt(activate(Sleepy, fresh=False))
            assert host.active is None
            await host.activate(activate(Sleepy, fresh=False))
            await host.close()
        compute.close()

    asyncio.run(main())
    assert EVENTS == [
        "sleepy:init",
        "sleepy:start",
        "sleepy:sleep",
        "other:init",
        "sleepy:wake",
        "sleepy:sleep",
        "sleepy:close",
        "sleepy:init",  # joined by migration: no start()
        "sleepy:sleep",
        "sleepy:close",
    ]


class Cyclic(WorkerGroup, kind=ComponentKind.TOOL, name="cyclic"):
    """A role in a reference cycle (as Megatron's modules and DDP are) holding a resource
    whose finaliser says when it is freed."""

    freed = False

    def __init__(self, ctx: RoleContext) -> None:
        self.me = self
        self.resource = Resource()
        weakref.finalize(self.resource, Cyclic.mark_freed)

    @staticmethod
    def mark_freed() -> None:
        Cyclic.freed = True


class Resource:
    """Something native a role might hold (a process group, a socket)."""


def test_a_torn_down_role_is_freed_at_once_even_in_a_reference_cycle() -> None:
    compute = ComputeThread()

    def context(command: Activate) -> RoleContext:
        return RoleContext(
            component=command.component, device=0, devices=command.devices,
            options=command.options, epoch=command.epoch, compute=compute,
            store=lambda: pytest.fail("no store in this test"), backend=ChannelTable(),
        )  # fmt: skip

    async def main() -> None:
        async with asyncio.TaskGroup() as group:
            host = RoleHost(0, group, context)
            await host.activate(activate(Cyclic))
            gc.disable()  # only the teardown's own collection may free it
            try:
                await host.deactivate("cyclic", keep=False)
                assert Cyclic.freed
            finally:
                gc.enable()

    asyncio.run(main())
    compute.close()


def test_a_role_that_cannot_be_imported_is_refused() -> None:
    async def main() -> None:
        async with asyncio.TaskGroup() as group:
            host = RoleHost(0, group, lambda command: pytest.fail("never built"))
            with pytest.raises(WorkerError, match="cannot import"):
                await host.activate(Activate(component="x", role="nowhere:Nothing", devices=(0,)))

    asyncio.run(main())
    with pytest.raises(ValueError, match="importable"):

        class Local(WorkerGroup, kind=ComponentKind.TOOL):
            pass

        role_path(Local)


def test_shard_files_written_by_one_layout_restore_another(tmp_path: Path) -> None:
    options = {"hidden": 8, "num_layers": 2}
    one = TinyState(options, TinyTrainer.plan_layout(options, (0,)), 0)
    one.initialise()
    one.step([], 0.1, None)
    reference = one.digest(None)
    save_shards(tmp_path / "a", 0, one.views())
    layout = TinyTrainer.plan_layout(options, (4, 5, 6))
    three = [TinyState(options, layout, rank) for rank in (4, 5, 6)]
    for state in three:
        load_shards(tmp_path / "a", state.views(), layout.tensor_map())
        save_shards(tmp_path / "b", state.rank, state.views())
    back = TinyState(options, TinyTrainer.plan_layout(options, (0,)), 0)
    load_shards(tmp_path / "b", back.views(), back.layout.tensor_map())
    assert back.digest(None) == reference
    assert any(t.abs().sum() > 0 for t in three[1].local.values())
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "shards-4.pt",
        "shards-5.pt",
        "shards-6.pt",
    ]
    empty = TinyState(options, TinyTrainer.plan_layout(options, (0,)), 0)
    with pytest.raises(ValueError):
        load_shards(tmp_path / "nothing", empty.views(), empty.layout.tensor_map())
    assert torch.equal(empty.local["embed.weight"], torch.zeros(64, 8))
