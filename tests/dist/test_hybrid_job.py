"""Asynchronous GRPO with hybrid replicas (seed 004) on the reference backend, for real.

One small job (two worker processes: a standalone rollout engine, and the trainer whose
device also serves as a hybrid rollout replica) runs standalone-only, then hybrid under
the ``default`` policy (deactivated once 30 % of a batch is buffered, the hybrid replica
still holds requests in flight). Checked:
every token of every sample trained at version v was generated at version v − 1 or v
(``max_staleness = 1``); the controller's orders (sync → add → resume → rebalance;
remove → abort → sleep) and the allocations they produced; a request aborted on the
hybrid replica and resumed on the standalone engine across a weight sync mixes versions;
the hybrid run's reward curve is within the stated tolerance of the standalone run's
(``compare_curves``: mean prompt-group reward over the last 3 steps, |Δ| ≤ 3·SE + 0.02).
"""

from __future__ import annotations

import asyncio

import pytest

from dynarl.backends.reference import AsyncConfig, AsyncRunResult, compare_curves, group_means
from dynarl.backends.reference.experiment import prepare_setup
from dynarl.backends.reference.hybrid_job import run_async
from dynarl.runtime.wire import decode_versions
from reference_support import SMALL_JOB, shared_cache

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
    assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False))
    # Active: both devices generate, the trainer sleeps; inactive: one each.
    shapes = [(c["rollout"], c.get("trainer", 0)) for _, c in hybrid.timeline]
    assert set(shapes) == {(1, 1), (2, 0)}
    assert any(step.wait_for_samples_s > 0 for step in hybrid.steps)


def test_a_request_aborted_and_resumed_across_a_weight_sync_mixes_versions(
    runs: dict[str, AsyncRunResult],
) -> None:
    hybrid = runs["hybrid"]
    assert hybrid.aborted, "deactivations aborted requests in flight on the hybrid replica"
    trained = {
        sid: (decode_versions(text), resumed)
        for step in hybrid.steps
        for sid, text, resumed in zip(step.sample_ids, step.versions, step.resumed, strict=True)
    }
    mixed = []
    for request_id, _generated, version in hybrid.aborted:
        sample_id = request_id.split("/")[0]  # a later turn of an episode: "<id>/t<k>"
        if sample_id not in trained:
            continue  # dropped for staleness, or not trained before the run ended
        versions, resumed = trained[sample_id]
        assert resumed >= 1
        # Tokens from before the abort (version <= the trainer's then) and from after
        # the weight sync that followed it (newer): the request crossed the sync.
        if min(versions) <= version < max(versions):
            mixed.append(sample_id)
    assert mixed, "an aborted request continued on the standalone engine after a weight sync"
    assert hybrid.staleness["mixed_resumed_samples"] >= len(set(mixed))


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
