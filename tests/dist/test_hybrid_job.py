"""Asynchronous GRPO with hybrid replicas (seed 004) on the reference backend, for real.

One small job (two worker processes: a standalone rollout engine, and the trainer whose
device also serves as a hybrid rollout replica) runs standalone-only, then hybrid under
the ``default`` policy (deactivated once 30 % of a batch is buffered, the hybrid replica
still holds requests in flight). Checked:
every token of every sample trained at version v was generated at version v − 1 or v
(``max_staleness = 1``); the controller's orders (sync → add → resume → rebalance;
remove → abort → sleep), the allocations and the ledger's migrations they produced; a
request aborted and resumed elsewhere whose generation spanned a weight sync mixes
versions (and no sample's versions ever decrease along its tokens);
the hybrid run's reward curve is within the stated tolerance of the standalone run's
(``compare_curves``: mean prompt-group reward over the last 3 steps, |Δ| ≤ 3·SE + 0.02).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
from reference_support import SMALL_JOB, shared_cache

from dynarl.demo._async_records import AsyncConfig, AsyncRunResult
from dynarl.demo._experiment import prepare_setup
from dynarl.demo._hybrid_job import run_async
from dynarl.demo._tolerance import compare_curves, group_means
from dynarl.runtime._worker_protocol import decode_versions

pytestmark = pytest.mark.dist

CONFIG = SMALL_JOB
PIPELINE = AsyncConfig(
    num_steps=5, num_groups=4, max_staleness=1, concurrent_samples_per_replica=8,
)  # fmt: skip
LAST_K = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, AsyncRunResult]:
    root = tmp_path_factory.mktemp("hybrid-job")
    setup = prepare_setup(CONFIG, shared_cache(tmp_path_factory))

    async def both() -> dict[str, AsyncRunResult]:
        out = {}
        for hybrid in (False, True):
            config = AsyncConfig(**{**_fields(PIPELINE), "hybrid": hybrid})
            result = await run_async(
                setup, config, run_dir=str(root / config.label), runtime=CONFIG.runtime()
            )
            out[result.label] = result
        return out

    return asyncio.run(both())


def _fields(config: AsyncConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_every_token_is_within_the_staleness_bound(runs: dict[str, AsyncRunResult]) -> None:
    batch = PIPELINE.num_groups * CONFIG.group_size
    for run in runs.values():
        assert len(run.steps) == PIPELINE.num_steps
        for step in run.steps:
            assert len(step.versions) == batch
            assert step.version == step.trainer_version + 1 == step.step + 1
            for text in step.versions:
                versions = decode_versions(text)
                assert versions, "a trained sample has generated tokens"
                assert all(
                    step.trainer_version - PIPELINE.max_staleness <= v <= step.trainer_version
                    for v in versions
                ), (step.step, text)
        assert run.staleness["max_staleness"] <= PIPELINE.max_staleness


def test_the_controller_switches_in_the_documented_orders(
    runs: dict[str, AsyncRunResult],
) -> None:
    standalone, hybrid = runs["standalone-only"], runs["hybrid"]
    assert standalone.activations == standalone.deactivations == 0
    assert standalone.replica_log == ()
    assert {tuple(c.items()) for _, c in standalone.timeline} == {(("rollout", 1), ("trainer", 1))}
    assert hybrid.activations >= 2 and hybrid.deactivations >= 1
    ops = [name for name, _ in hybrid.replica_log]
    cycles: list[list[str]] = []
    for name in ops:
        if name in ("sync_hybrid_weights", "remove_replicas"):
            cycles.append([])
        cycles[-1].append(name)
    for cycle in cycles:
        assert cycle in (
            ["sync_hybrid_weights", "add_replicas", "resume_generation_replicas", "rebalance"],
            ["remove_replicas", "abort_replicas", "sleep_replicas"],
        ), cycle
    # Activations and deactivations alternate, starting with an activation.
    kinds = [c[0] for c in cycles]
    assert kinds[0] == "sync_hybrid_weights"
    assert all(a != b for a, b in itertools.pairwise(kinds))
    # Active: both devices generate, the trainer sleeps; inactive: one each.
    shapes = [(c["rollout"], c.get("trainer", 0)) for _, c in hybrid.timeline]
    assert set(shapes) == {(1, 1), (2, 0)}
    assert any(step.wait_for_samples_s > 0 for step in hybrid.steps)
    # The ledger: each switch is two committed migrations, the donor first — activation:
    # the trainer sleeps in place, then the rollout grows onto its device; deactivation:
    # the rollout's workload migration (stop routing, abort, re-dispatch, release), then
    # the trainer wakes in place.
    records = [
        json.loads(line)
        for line in (Path(hybrid.run_dir) / "events.jsonl").read_text().splitlines()
    ]
    moves = [
        (r["component"], r["kind"], tuple(r["dst_devices"]))
        for r in records
        if r["type"] == "MigrationRecord" and r["outcome"] == "committed"
    ]
    assert len(moves) == 2 * (hybrid.activations + hybrid.deactivations)
    pairs = [tuple(moves[i : i + 2]) for i in range(0, len(moves), 2)]
    activate = (("trainer", "reboot", ()), ("rollout", "workload", (0, 1)))
    deactivate = (("rollout", "workload", (0,)), ("trainer", "reboot", (1,)))
    assert pairs == [activate, deactivate] * hybrid.deactivations + [activate] * (
        hybrid.activations - hybrid.deactivations
    )


def test_an_aborted_and_resumed_request_mixes_weight_versions(
    runs: dict[str, AsyncRunResult],
) -> None:
    """Requests are aborted (deactivation: on the hybrid replica; rebalance: on the
    standalone engine) and resumed elsewhere with their partial output; at least one
    sample that was aborted and resumed carries tokens of two weight versions (its
    generation spanned a weight sync), and every sample's versions never decrease
    along its tokens (a resumed request never goes back to older weights)."""
    hybrid = runs["hybrid"]
    assert hybrid.rebalanced + len(hybrid.aborted) > 0
    mixed_resumed = []
    for step in hybrid.steps:
        for sid, text, resumed in zip(step.sample_ids, step.versions, step.resumed, strict=True):
            versions = decode_versions(text)
            assert versions == sorted(versions), (sid, text)
            if resumed and len(set(versions)) > 1:
                mixed_resumed.append(sid)
    assert mixed_resumed, "no aborted and resumed sample spanned a weight sync"
    assert hybrid.staleness["mixed_resumed_samples"] == len(mixed_resumed)


def test_hybrid_rewards_are_within_tolerance_of_standalone(
    runs: dict[str, AsyncRunResult],
) -> None:
    standalone, hybrid = runs["standalone-only"], runs["hybrid"]
    assert hybrid.num_samples == standalone.num_samples
    per_step = {
        label: [group_means(s.rewards, CONFIG.group_size) for s in run.steps]
        for label, run in runs.items()
    }
    outcome = compare_curves(per_step["hybrid"], per_step["standalone-only"], last_k=LAST_K)
    assert outcome.within, outcome.describe()


def test_dynamic_resource_metrics_are_reported(runs: dict[str, AsyncRunResult]) -> None:
    for run in runs.values():
        for step in run.steps:
            m = step.metrics
            for name in ("train", "rollout", ""):
                key = f"dynamic_resource/{name + '_' if name else ''}resource_utilization"
                assert 0.0 <= m[key] <= 1.0, (key, m)
            assert m["dynamic_resource/mq_size"] >= 0
            assert step.update_s <= m["dynamic_resource/train_allocated_time_s"]
