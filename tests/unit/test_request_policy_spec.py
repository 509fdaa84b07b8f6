"""A user's request policy, named in a ComponentSpec, orders the component's dispatch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

from dynarl.bus import BusConfig, Sample
from dynarl.runtime import ComponentSpec, RuntimeConfig
from dynarl.runtime.controller._group_manager import GroupManager
from dynarl.runtime.controller._link import WorkerLink
from dynarl.sched import FifoPolicy, ManualClock, RequestPolicy, RoutedItem
from dynarl.testing import ScriptedRollout


def dispatch_order(tmp_path: Path, policy: RequestPolicy | None) -> list[str]:
    async def sink(sample: Sample) -> None:
        raise AssertionError("nothing is served here")

    async def main() -> list[str]:
        spec = ComponentSpec(role=ScriptedRollout, devices=(0,), request_policy=policy)
        manager = GroupManager(
            spec,
            link=cast(WorkerLink, None),  # never reached: nothing is sent
            config=RuntimeConfig(),
            bus=BusConfig(),
            clock=ManualClock(),
            report=lambda report: None,
            output=sink,
            run_dir=tmp_path,
        )
        assert manager.dispatcher is not None
        router = manager.dispatcher.router
        router.add_worker(0)
        router.distribute_data(
            [RoutedItem(item_id=f"r{k}", episode=f"e{k}", status=k) for k in range(4)]
        )
        return [r.request_id for r in router.priority_schedule(0, 4)]

    return asyncio.run(main())


def test_the_spec_policy_orders_the_queue(tmp_path: Path) -> None:
    # Default: DynaRL's priority, most completed tool calls first.
    assert dispatch_order(tmp_path, None) == ["r3", "r2", "r1", "r0"]
    assert dispatch_order(tmp_path, FifoPolicy()) == ["r0", "r1", "r2", "r3"]
