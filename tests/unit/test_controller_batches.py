"""The live controller hands the scheduler what is queued as one batch: one round on it.

A real :class:`~dynarl.runtime.controller._controller.Controller` (its TCPStore, bus server,
publisher, managers and scheduler task; no workers). Reports go in through the callback
the group managers are wired with; the scheduler reads the controller's queue through
``queued_batches``, and a spy on its ``handle_many`` keeps each batch it is handed. The
decision interval is an hour of the controller's clock, so the
scheduler's first round is the only one the test can see: were the reports handled one at
a time, that round would hold only the first component's report.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

from sched_support import report

from dynarl.bus import ComponentReport, DecisionRecord
from dynarl.runtime import ComponentSpec, RuntimeConfig
from dynarl.runtime.controller._controller import Controller
from dynarl.sched import LedgerRecord, MigrationCommand, SchedulerConfig, SchedulerEvent
from dynarl.sched._ledger_records import ObservationRecord
from dynarl.testing import ScriptedRollout, ShadowTrainer, TinyTrainer
from dynarl.types import MigrationKind

HOUR_S = 3600.0
KINDS = {"rollout": "rollout", "trainer": "trainer", "shadow": "trainer"}
SPECS = [
    ComponentSpec(role=ScriptedRollout, devices=(0, 1)),
    ComponentSpec(role=TinyTrainer, devices=(2,)),
    ComponentSpec(role=ShadowTrainer, devices=(3,), migration=MigrationKind.REBOOT),
]


def test_reports_queued_together_make_one_round_that_holds_them_all(tmp_path: Path) -> None:
    config = RuntimeConfig(
        scheduler=SchedulerConfig(decision_interval_s=HOUR_S), report_interval_s=HOUR_S
    )

    async def main() -> list[LedgerRecord]:
        async with (
            asyncio.timeout(60),
            Controller(SPECS, num_devices=4, run_dir=tmp_path, config=config) as controller,
        ):
            batches: list[list[SchedulerEvent]] = []
            sent: list[ComponentReport] = []
            handled = asyncio.Event()
            scheduler = controller.scheduler
            handle_many = scheduler.handle_many

            def spy(events: Iterable[SchedulerEvent]) -> list[MigrationCommand]:
                batches.append(list(events))
                handled.set()
                return handle_many(batches[-1])

            scheduler.handle_many = spy  # type: ignore[method-assign]
            now = scheduler.clock.now()
            # The managers' report callback; no await between the calls, so all three are
            # queued before the scheduler's task runs again.
            for depth, (name, kind) in enumerate(KINDS.items(), start=1):
                sent.append(report(name, kind=kind, time=now, queue_depth=depth))
                controller._on_report(sent[-1])
            async with asyncio.timeout(10):
                await handled.wait()
            assert batches == [sent]
            return controller.ledger.query()

    records = asyncio.run(main())
    decisions = [r for r in records if isinstance(r, DecisionRecord)]
    seen = [r for r in records if isinstance(r, ObservationRecord)]
    assert len(decisions) == 1 and len(seen) == 1
    (observation,) = seen
    assert observation.record_id == decisions[0].decision_id
    depths = {name: c.queue_depth for name, c in observation.components.items()}
    assert depths == {"rollout": 1, "trainer": 2, "shadow": 3}
