"""A real job (worker processes, the bus, the scheduler) seen from outside: its Prometheus
endpoint scraped while it runs, and ``dynarl events`` on the run directory it leaves."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import dynarl
from dynarl.bus import GenerationRequest, pack_tokens
from dynarl.cli import main
from dynarl.sched import ComponentProfile, ProfilePoint, SchedulerConfig
from dynarl.testing import ScriptedRollout, TinyTrainer

pytestmark = pytest.mark.dist


def components() -> list[dynarl.ComponentSpec]:
    rollout = ComponentProfile(
        points=(
            ProfilePoint(num_devices=1, throughput=4.0),
            ProfilePoint(num_devices=2, throughput=8.0),
        ),
        items_per_device=8.0,
    )
    trainer = ComponentProfile(
        points=(
            ProfilePoint(num_devices=1, throughput=1.0),
            ProfilePoint(num_devices=2, throughput=2.0),
        )
    )
    return [
        dynarl.ComponentSpec(
            role=ScriptedRollout,
            devices=(0, 1),
            options={"tokens_per_s": 60.0, "kv_capacity": 4096},
            profile=rollout,
        ),
        dynarl.ComponentSpec(
            role=TinyTrainer, devices=(2,), options={"step_s": 0.2}, profile=trainer
        ),
    ]


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def run_job(run_dir: Path) -> tuple[dict[str, float], dict[str, int]]:
    scheduler = SchedulerConfig(donor_window_s=1.0, stats_window_s=5.0, decision_interval_s=0.5)
    runtime = dynarl.RuntimeConfig(scheduler=scheduler, report_interval_s=0.5, metrics_port=0)
    config = dynarl.JobConfig(run_dir=str(run_dir), runtime=runtime)
    async with dynarl.Job(components(), config) as job:
        assert job.metrics is not None
        count = 8
        job.submit(
            "rollout",
            [
                GenerationRequest(
                    sample_id=f"q{i}",
                    prompt_id=f"q{i}",
                    token_ids=pack_tokens(list(range(100 + i))),
                    max_new_tokens=300 if i < 2 else 30,
                )
                for i in range(count)
            ],
        )
        job.set_remaining("trainer", 4 * count)
        finished = job.output("rollout")
        for _ in range(count):
            sample = await finished.get(timeout=120)
            await job.call("trainer", "train_step", [sample])
        job.new_iteration()
        await asyncio.sleep(1.5)  # a report of the next iteration closes the last move
        scraped = await asyncio.to_thread(scrape, job.metrics.url)
        return scraped, job.allocation.counts()


def test_a_job_scraped_while_running_then_summarised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scraped, final = asyncio.run(run_job(tmp_path))
    assert scraped['dynarl_allocation_devices{"component": "trainer"}'] == final["trainer"]
    assert scraped['dynarl_allocation_devices{"component": "rollout"}'] == final["rollout"]
    assert scraped['dynarl_peer_events_total{"event": "registered"}'] >= 3
    assert 'dynarl_utilization{"component": "rollout"}' in scraped
    rounds = sum(v for k, v in scraped.items() if k.startswith("dynarl_decision_rounds_total"))
    assert rounds >= 1
    assert main(["events", str(tmp_path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["num_rounds"] >= rounds
    assert {c["component"] for c in document["components"]} == {"rollout", "trainer"}
    moves = document["moves"]
    if final["trainer"] > 1:  # the scheduler moved a device: its migrations are accounted
        assert moves and moves[0]["migrations"]
        kinds = {(m["kind"], m["component"]) for m in document["migrations"]}
        assert ("p2p", "trainer") in kinds
    assert main(["events", str(tmp_path)]) == 0
    assert "decision rounds" in capsys.readouterr().out
