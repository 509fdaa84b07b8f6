"""A worker that dies outside a migration: how its death is read, what the quota plan does
with its device, and how the serving path, a trainer's manager and the job's waiters
take it — in one process, without workers (the whole job: tests/dist/test_worker_loss.py)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from dynarl.bus import BusConfig, GenerationRequest, Sample, pack_tokens
from dynarl.bus._channel import ChannelTable
from dynarl.errors import PeerLostError, WorkerLostError
from dynarl.runtime import ComponentSpec, RuntimeConfig
from dynarl.runtime._worker_protocol import FINISH, AbortInflight, Deactivate, Done, RoleStatus
from dynarl.runtime.controller._dispatch import Dispatcher
from dynarl.runtime.controller._group_manager import GroupManager
from dynarl.runtime.controller._link import WorkerLink
from dynarl.runtime.controller._losses import GuardedChannels, Losses, WorkerLoss, exit_cause
from dynarl.sched import HyperNode, ManualClock, QuotaChange, SchedulerConfig
from dynarl.sched._quota import QuotaPlan, plan_quota_change
from dynarl.testing import TinyTrainer
from dynarl.types import Allocation, ComponentKind

LOSS = WorkerLoss(device=1, cause="killed by SIGKILL", pid=42, component="rollout")

# ---------------------------------------------------------------- reading a death


def _ended(pid: int) -> str | None:
    for _ in range(400):
        cause = exit_cause(pid)
        if cause is not None:
            return cause
        time.sleep(0.01)
    return None


def test_a_process_end_is_read_and_its_status_left_to_its_parent() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert exit_cause(sleeper.pid) is None
        sleeper.send_signal(signal.SIGKILL)
        assert _ended(sleeper.pid) == "killed by SIGKILL"
    finally:
        sleeper.kill()
        assert sleeper.wait(timeout=10) == -signal.SIGKILL  # still the launcher's to reap
    quitter = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert _ended(quitter.pid) == "exited with status 3"
    assert quitter.wait(timeout=10) == 3
    assert exit_cause(quitter.pid) == "exited"  # reaped: only that it is gone


def test_a_loss_names_component_worker_device_pid_and_cause() -> None:
    error = LOSS.error("the job cannot go on", fatal=True)
    assert str(error) == (
        "component 'rollout' lost worker 'worker/1' on device 1 (pid 42, killed by SIGKILL): "
        "the job cannot go on"
    )
    assert (error.component, error.worker, error.device, error.cause, error.fatal) == (
        "rollout", "worker/1", 1, "killed by SIGKILL", True,
    )  # fmt: skip


# ---------------------------------------------------------------- the quota plan

ROLLOUT = HyperNode(name="rollout", kind=ComponentKind.ROLLOUT, min_devices=1)
TRAINER = HyperNode(name="trainer", kind=ComponentKind.TRAINER, min_devices=1)
NODES = {"rollout": ROLLOUT, "trainer": TRAINER}


def lose(
    assignment: dict[str, list[int]], lost: Sequence[int], quota: set[int] | None = None
) -> QuotaPlan:
    allocation = Allocation.of(assignment)
    held = {d for devices in assignment.values() for d in devices}
    return plan_quota_change(
        QuotaChange(reclaimed=tuple(lost), lost=True),
        quota=held if quota is None else quota,
        allocation=allocation,
        nodes=NODES,
        config=SchedulerConfig(),
    )


def test_a_lost_device_of_a_component_with_others_left_only_shrinks_it() -> None:
    plan = lose({"rollout": [0, 1], "trainer": [2]}, [1])
    assert not plan.refused and plan.reclaimed == {1} and plan.num_devices == 2
    assert plan.new_allocation == Allocation.of({"rollout": [0], "trainer": [2]})


def test_a_components_last_lost_device_is_replaced_by_a_free_one_first() -> None:
    plan = lose({"rollout": [0], "trainer": [1, 2]}, [0], quota={0, 1, 2, 3})
    assert plan.new_allocation == Allocation.of({"rollout": [3], "trainer": [1, 2]})


def test_a_components_last_lost_device_is_replaced_by_one_another_can_spare() -> None:
    plan = lose({"rollout": [0], "trainer": [1, 2]}, [0])
    assert not plan.refused and plan.new_allocation is not None
    assert plan.new_allocation.count("rollout") == plan.new_allocation.count("trainer") == 1
    assert [(m.src, m.dst) for m in plan.moves] == [("rollout", None), ("trainer", "rollout")]
    trainer_lost_its_rank = lose({"rollout": [0, 1], "trainer": [2]}, [2])
    assert trainer_lost_its_rank.new_allocation is not None
    assert trainer_lost_its_rank.new_allocation.count("trainer") == 1


def test_a_lost_device_nobody_can_replace_is_refused_and_a_cluster_reclaim_unchanged() -> None:
    plan = lose({"rollout": [0], "trainer": [1]}, [0])
    assert plan.refused == (
        "reclaim refused: rollout lost its devices and no component can spare the 1 it needs"
    )
    assert plan.moves == () and plan.new_allocation is None
    cluster = plan_quota_change(
        QuotaChange(reclaimed=(0,)),
        quota={0, 1, 2},
        allocation=Allocation.of({"rollout": [0], "trainer": [1, 2]}),
        nodes=NODES,
        config=SchedulerConfig(),
    )
    assert cluster.refused == "reclaim refused: rollout would fall below its minimum of 1 devices"


def test_a_lost_device_already_off_the_quota_is_reclaimed_again() -> None:
    # An earlier reclaim took it off the quota and then failed: the device is still held.
    plan = lose({"rollout": [0, 1], "trainer": [2]}, [1], quota={0, 2})
    assert plan.reclaimed == {1} and plan.new_allocation == Allocation.of(
        {"rollout": [0], "trainer": [2]}
    )


# ---------------------------------------------------------------- waiting on a dead worker


def test_a_request_to_a_worker_lost_meanwhile_fails_at_once() -> None:
    async def main() -> None:
        losses = Losses()
        never = asyncio.Event()
        waiting = asyncio.ensure_future(losses.unless_lost(1, never.wait()))
        await asyncio.sleep(0.01)
        losses.lose(LOSS)
        with pytest.raises(PeerLostError, match=r"worker/1 was lost \(killed by SIGKILL\)"):
            await waiting
        with pytest.raises(PeerLostError):
            await losses.unless_lost(1, never.wait())
        assert await losses.unless_lost(2, asyncio.sleep(0, "ok")) == "ok"

    asyncio.run(main())


def test_a_job_that_cannot_go_on_wakes_its_channel_readers_with_one_error() -> None:
    async def main() -> None:
        losses = Losses()
        table = ChannelTable()
        guarded = GuardedChannels(table, losses)
        reader = asyncio.ensure_future(guarded.channel_get("out", "", capacity=4, timeout=None))
        await asyncio.sleep(0.01)
        losses.fail(LOSS, "reclaim refused")
        with pytest.raises(WorkerLostError) as stopped:
            await reader
        assert stopped.value.fatal and str(stopped.value).endswith(
            "(pid 42, killed by SIGKILL): reclaim refused"
        )
        losses.fail(WorkerLoss(device=2, cause="exited with status 1"), "later")
        with pytest.raises(WorkerLostError, match="reclaim refused"):  # the first one stays
            await guarded.channel_put(
                "out",
                "",
                Sample(sample_id="s", token_ids=b"", prompt_len=0),
                capacity=4,
                timeout=None,
            )

    asyncio.run(main())


# ---------------------------------------------------------------- the serving path


class Workers:
    """Serving workers in this process; a lost one never answers (its request hangs
    until the link fails it), as a killed process does."""

    def __init__(self, losses: Losses) -> None:
        self.losses = losses
        self.dead: set[int] = set()
        self.served: Counter[int] = Counter()
        self.asked: list[tuple[int, ...]] = []

    async def serve(self, device: int, item: Any, *, deadline_s: float) -> Sample:
        return await self.losses.unless_lost(device, self._serve(device, item))

    async def _serve(self, device: int, item: GenerationRequest) -> Sample:
        self.served[device] += 1
        if device in self.dead:
            await asyncio.Event().wait()
        await asyncio.sleep(0.01)
        return Sample(
            sample_id=item.sample_id,
            token_ids=item.token_ids,
            prompt_len=1,
            metadata={FINISH: "length", "device": device},
        )

    async def ask_all(
        self, devices: Sequence[int], message: Any, reply: type, **_: Any
    ) -> list[Done]:
        assert isinstance(message, AbortInflight)
        self.asked.append(tuple(devices))
        return [Done() for _ in devices]


class Roles:
    def __init__(self) -> None:
        self.released: list[tuple[int, ...]] = []

    async def activate(self, devices: Sequence[int]) -> None:
        raise AssertionError("nothing is activated here")

    async def release(self, devices: Sequence[int]) -> None:
        self.released.append(tuple(devices))


def test_a_lost_workers_items_continue_on_the_others_exactly_once() -> None:
    async def main() -> tuple[list[Sample], Workers]:
        losses = Losses()
        workers, roles, out = Workers(losses), Roles(), []

        async def sink(sample: Sample) -> None:
            out.append(sample)

        dispatcher = Dispatcher(
            "rollout", link=cast(WorkerLink, workers), roles=roles, output=sink,
            max_inflight=2, item_timeout_s=30.0, drain_timeout_s=5.0, losses=losses,
        )  # fmt: skip
        stop = asyncio.Event()
        async with asyncio.timeout(30), asyncio.TaskGroup() as group:
            group.create_task(dispatcher.run(stop))
            await asyncio.sleep(0)
            workers.dead.add(1)
            dispatcher.add_worker(0)
            dispatcher.add_worker(1)
            dispatcher.submit(
                [
                    GenerationRequest(
                        sample_id=f"r{i}", token_ids=pack_tokens([i]), max_new_tokens=4
                    )
                    for i in range(8)
                ]
            )
            await asyncio.sleep(0.05)  # two requests hang on worker 1
            losses.lose(LOSS)
            dispatcher.lose_worker(1)
            # The reclaim: a workload migration off the dead worker asks nothing of it.
            await dispatcher.stop_routing([1])
            partials = await dispatcher.abort_inflight([1])  # the two that hung, no tokens
            assert len(partials) == 2 and all(not p.generated for p in partials)
            await dispatcher.redispatch(partials, [0])
            await dispatcher.release([1])
            for _ in range(3000):
                if not dispatcher.remaining:
                    break
                await asyncio.sleep(0.01)
            stop.set()
        assert roles.released == [(1,)] and workers.asked == [()]
        return out, workers

    out, workers = asyncio.run(main())
    assert Counter(s.sample_id for s in out) == Counter(f"r{i}" for i in range(8))
    assert all(s.metadata[FINISH] == "length" and s.metadata["device"] == 0 for s in out)
    assert workers.served[1] == 2  # the two that hung, and nothing after the loss


# ---------------------------------------------------------------- a trainer's manager


class Link:
    """A link to trainer ranks in this process: it records what it was asked."""

    def __init__(self) -> None:
        self.losses = Losses()
        self.asked: list[tuple[int, str]] = []

    async def ask(self, device: int, message: Any, reply: type, **_: Any) -> Any:
        async def answer() -> Any:
            self.asked.append((device, type(message).__name__))
            return RoleStatus(device=device)

        return await self.losses.unless_lost(device, answer())

    async def ask_all(
        self, devices: Sequence[int], message: Any, reply: type, **_: Any
    ) -> list[Any]:
        return [await self.ask(d, message, reply) for d in devices]


def trainer(tmp_path: Path, link: Link) -> GroupManager:
    async def sink(sample: Sample) -> None:
        raise AssertionError("a trainer serves nothing")

    manager = GroupManager(
        ComponentSpec(role=TinyTrainer, devices=(1, 2)), link=cast(WorkerLink, link),
        config=RuntimeConfig(), bus=BusConfig(), clock=ManualClock(),
        report=lambda report: None, output=sink, run_dir=tmp_path,
    )  # fmt: skip
    manager.set_devices((1, 2))
    return manager


def test_a_trainer_that_lost_a_rank_refuses_calls_and_reshards_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        link = Link()
        manager = trainer(tmp_path, link)
        loss = WorkerLoss(device=2, cause="killed by SIGKILL", pid=7, component="trainer")
        link.losses.lose(loss)
        manager.lost = loss
        with pytest.raises(WorkerLostError, match=r"until DurableRun\.restore") as refused:
            await manager.call("train_step", [], {})
        assert not refused.value.fatal and refused.value.device == 2
        common = {"migration_id": "m", "src": (1, 2), "dst": (1,), "epoch": 3, "lease_s": 5.0}
        for step in ("prepare", "transfer", "verify"):
            results = await manager.reshard(step, **common)  # type: ignore[arg-type]
            assert [(r.device, r.ok) for r in results] == [(1, True), (2, True)]
        assert link.asked == []  # nothing to move: no rank was asked
        await manager.reshard("commit", **common)  # type: ignore[arg-type]
        assert link.asked == [(1, Deactivate.__name__)]  # the survivor's role is torn down
        await manager.teardown((1, 2))  # the dead rank is skipped
        assert link.asked == [(1, Deactivate.__name__)] * 2
        manager.restored()
        link.losses.fail(loss, "no checkpoint")
        with pytest.raises(WorkerLostError, match="no checkpoint") as stopped:
            await manager.call("train_step", [], {})
        assert stopped.value.fatal

    asyncio.run(main())
