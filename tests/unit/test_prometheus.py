"""The Prometheus endpoint, scraped over HTTP: scheduler gauges, ledger counters (each
record counted once), the dynamic_resource/* gauges, and what it refuses."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sched_support import PowerLawPredictor, report

from dynarl.bus import DecisionRecord, MigrationRecord, NoDonor
from dynarl.runtime import MetricsExporter
from dynarl.sched import (
    DynamicResourceMetrics,
    HyperNode,
    ManualClock,
    MoveOutcome,
    OperatorCommand,
    Scheduler,
    SchedulerConfig,
    StaticMigrationCost,
)
from dynarl.types import Allocation, ComponentKind, MigrationKind

NODES = {
    "rollout": HyperNode(name="rollout", kind=ComponentKind.ROLLOUT, min_devices=2),
    "trainer": HyperNode(
        name="trainer", kind=ComponentKind.TRAINER, migration=MigrationKind.P2P, tp=2
    ),
}


def scheduler() -> Scheduler:
    return Scheduler(
        graph=NODES,
        allocation=Allocation.of({"rollout": range(0, 12), "trainer": range(12, 16)}),
        predictor=PowerLawPredictor({"rollout": (100.0, 0.9, 4.0), "trainer": (10.0, 1.0, 0.0)}),
        cost=StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 1.0, MigrationKind.P2P: 2.0}),
        clock=ManualClock(),
        config=SchedulerConfig(num_devices_per_node=4, min_move_interval_s=0.0),
    )


def drive(s: Scheduler) -> str:
    """A rollout tail until the scheduler commits; the move's migrations; its id."""
    assert isinstance(s.clock, ManualClock)
    while True:
        t = s.clock.advance(1.0)
        util = (0.05,) * s.allocation.count("rollout")
        commands = s.handle(report("rollout", time=t, utilization=util, remaining=8))
        trainer = report(
            "trainer", kind="trainer", time=t, utilization=(1.0, 1.0), remaining=900, queue_depth=9
        )
        commands += s.handle(trainer)
        if commands:
            break
    (command,) = commands
    records = tuple(
        MigrationRecord(
            migration_id=f"m{i}",
            decision_id=command.decision_id,
            time=t,
            kind=kind,
            component=name,
            src_devices=command.old_allocation.devices(name),
            dst_devices=command.new_allocation.devices(name),
            outcome="committed",
            bytes_moved=nbytes,
            pause_s=pause,
        )
        for i, (kind, name, nbytes, pause) in enumerate(
            [("workload", "rollout", 0, 1.5), ("p2p", "trainer", 4096, 0.3)]
        )
    )
    outcome = MoveOutcome(
        decision_id=command.decision_id,
        ok=True,
        allocation=command.new_allocation,
        records=records,
    )
    s.handle(outcome)
    return command.decision_id


async def fetch(url: str, method: str = "GET") -> tuple[int, str, str]:
    def get() -> tuple[int, str, str]:
        request = urllib.request.Request(url, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                body = response.read().decode()
                return response.status, response.headers["Content-Type"], body
        except urllib.error.HTTPError as err:
            return err.code, err.headers["Content-Type"], ""

    return await asyncio.to_thread(get)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_scraped_over_http() -> None:
    s = scheduler()
    decision_id = drive(s)
    cycle = DynamicResourceMetrics(hybrid_devices=4, standalone_devices=12)
    cycle.add_step(
        timing={"update_actor": 3.0}, allocated_s=4.0, step_s=4.0, wait_for_samples_s=1.0, mq_size=7
    )

    async def main() -> tuple[str, str, int, int, int]:
        async with MetricsExporter(s) as exporter:
            assert exporter.url.startswith("http://127.0.0.1:") and exporter.port > 0
            exporter.record_cycle(cycle.cycle(rollout_utilization=0.5))
            s.ledger.fill_realised(
                decision_id, realised_iteration_delta_s=-1.0, prediction_error=0.2
            )
            s.ledger.fill_realised(decision_id, prediction_error=0.2)  # counted once
            s.handle(OperatorCommand(action="enter_safe_mode", reason="test"))
            status, kind, text = await fetch(exporter.url)
            assert status == 200 and kind.startswith("text/plain")
            missing, _, _ = await fetch(exporter.url.replace("/metrics", "/nothing"))
            head, _, empty = await fetch(exporter.url, method="HEAD")
            posted, _, _ = await fetch(exporter.url, method="POST")
            assert empty == ""
            return text, kind, missing, head, posted

    text, _, missing, head, posted = asyncio.run(main())
    assert (missing, head, posted) == (404, 200, 405)
    got = samples(text)
    new = s.allocation
    assert got[("dynarl_allocation_devices", (("component", "trainer"),))] == new.count("trainer")
    assert got[("dynarl_allocation_devices", (("component", "rollout"),))] == new.count("rollout")
    assert got[("dynarl_free_devices", ())] == 0
    assert got[("dynarl_queue_depth", (("component", "trainer"),))] == 9
    assert got[("dynarl_remaining_items", (("component", "rollout"),))] == 8
    assert got[("dynarl_safe_mode", ())] == 1 and got[("dynarl_move_in_flight", ())] == 0
    assert got[("dynarl_decision_rounds_total", (("result", "committed"),))] == 1
    assert got[("dynarl_decision_rounds_total", (("result", "hold"),))] >= 1
    labels = (("component", "trainer"), ("kind", "p2p"), ("outcome", "committed"))
    assert got[("dynarl_migrations_total", labels)] == 1
    assert (
        got[("dynarl_migration_bytes_total", (("component", "trainer"), ("kind", "p2p")))] == 4096
    )
    assert got[("dynarl_migration_pause_seconds_count", (("kind", "workload"),))] == 1
    assert got[("dynarl_migration_pause_seconds_sum", (("kind", "workload"),))] == 1.5
    assert got[("dynarl_move_prediction_error_count", ())] == 1
    # Signed buckets (OpenMetrics then leaves out the _sum): +20% is above +10%, below +25%.
    assert got[("dynarl_move_prediction_error_bucket", (("le", "0.1"),))] == 0
    assert got[("dynarl_move_prediction_error_bucket", (("le", "0.25"),))] == 1
    assert got[("dynarl_move_realised_gain_seconds", ())] == 1.0
    assert got[("dynarl_safe_mode_entries_total", ())] == 1
    assert got[("dynarl_dynamic_resource_train_resource_utilization", ())] == 0.75
    assert got[("dynarl_dynamic_resource_mq_size", ())] == 7
    assert ("dynarl_prediction_error_ratio", (("component", "trainer"),)) not in got  # no samples


def test_refusals() -> None:
    s = scheduler()

    async def main() -> None:
        exporter = MetricsExporter(s)
        with pytest.raises(ValueError, match="not a dynamic_resource"):
            exporter.record_cycle({"train_utilization": 1.0})
        await exporter.start()
        try:
            with pytest.raises(OSError):
                await MetricsExporter(s, port=exporter.port).start()
        finally:
            await exporter.aclose()
            await exporter.aclose()

    asyncio.run(main())
    with pytest.raises(ValueError, match="metrics port"):
        MetricsExporter(s, port=70000)


def test_the_endpoint_is_on_by_default_and_known_missing_without_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dynarl.runtime import RuntimeConfig
    from dynarl.runtime.controller import _prometheus as prometheus

    assert RuntimeConfig().metrics_port == 0
    assert prometheus.metrics_available()
    real = prometheus.importlib.util.find_spec
    monkeypatch.setattr(
        prometheus.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "prometheus_client" else real(name, *a),
    )
    assert not prometheus.metrics_available()


def test_rounds_are_counted_once_with_memory_bounded_in_a_long_job() -> None:
    s = scheduler()
    exporter = MetricsExporter(s)
    hold = DecisionRecord(
        decision_id="", time=0.0, committed=False, reason=NoDonor(),
        old_allocation={"rollout": 12, "trainer": 4}, new_allocation={"rollout": 12, "trainer": 4},
    )  # fmt: skip
    num = 5000
    for i in range(num):
        s.ledger.append(msgspec.structs.replace(hold, decision_id=f"h{i}", time=float(i)))
    s.ledger.append(msgspec.structs.replace(hold, decision_id=f"h{num - 1}", time=float(num)))
    moved = drive(s)
    s.ledger.fill_realised(moved, realised_iteration_delta_s=-1.0, prediction_error=0.1)
    rounds = {
        dict(labels)["result"]: value
        for (name, labels), value in samples(generate_latest(exporter.registry).decode()).items()
        if name == "dynarl_decision_rounds_total"
    }
    # Every round once: the re-appended hold and the filled-in move are not counted again.
    assert sum(rounds.values()) == len(s.ledger.query(kind="decision"))
    assert rounds["committed"] == 1
    # White box: a job with a round a second does not grow the exporter's memory.
    assert len(exporter._rounds) <= 4096
