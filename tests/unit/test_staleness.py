"""The staleness gate and the message queue between an asynchronous rollout and trainer."""

from __future__ import annotations

import asyncio

import pytest

from dynarl.backends.reference._staleness import (
    MessageQueue,
    StalenessStats,
    group_admissible,
    sample_staleness,
    token_versions,
)
from dynarl.bus._messages import Sample, pack_tokens
from dynarl.runtime._worker_protocol import RESUMED, VERSIONS, decode_versions, encode_versions


def sample(sid: str, versions: list[int], *, resumed: int = 0) -> Sample:
    return Sample(
        sample_id=sid,
        token_ids=pack_tokens([1, 2] + [3] * len(versions)),
        prompt_len=2,
        prompt_id=f"p{sid}",
        metadata={VERSIONS: encode_versions(versions), RESUMED: resumed, "seed_id": int(sid)},
    )


def test_staleness_is_counted_from_the_oldest_token() -> None:
    mixed = sample("1", [3, 3, 4, 5])
    assert token_versions(mixed) == [3, 3, 4, 5]
    assert sample_staleness(mixed, 5) == 2
    assert sample_staleness(sample("2", []), 9) == 0
    assert group_admissible([mixed, sample("3", [5])], 5, 2)
    assert not group_admissible([mixed, sample("3", [5])], 5, 1)


def test_stats_count_mixed_and_resumed_samples() -> None:
    stats = StalenessStats()
    stats.admit([sample("1", [1, 2], resumed=1), sample("2", [2]), sample("3", [1, 2])], 2)
    stats.drop([sample("4", [0])])
    summary = stats.summary()
    assert summary["samples"] == 3 and summary["max_staleness"] == 1
    assert summary["mixed_version_samples"] == 2 and summary["mixed_resumed_samples"] == 1
    assert summary["dropped_groups"] == 1 and summary["dropped_samples"] == 1


def test_queue_drops_stale_groups_for_regeneration_and_keeps_order() -> None:
    regenerated: list[str] = []

    async def scenario() -> list[list[Sample]]:
        queue = MessageQueue(
            capacity_samples=4,
            max_staleness=1,
            regenerate=lambda g: regenerated.append(g[0].sample_id),
        )
        for i, versions in enumerate(([2], [0, 2], [1], [2])):
            await queue.reserve(1)
            await queue.put([sample(str(i), versions)])
        assert queue.size == 4 and queue.generated_samples == 4
        async with asyncio.timeout(5):
            return await queue.take(3, trainer_version=2)

    taken = asyncio.run(scenario())
    assert [g[0].sample_id for g in taken] == ["0", "2", "3"]
    assert regenerated == ["1"]


def test_reserve_pauses_the_rollout_at_the_bound_until_a_take() -> None:
    async def scenario() -> tuple[bool, bool]:
        queue = MessageQueue(capacity_samples=2, max_staleness=0, regenerate=lambda g: None)
        await queue.reserve(2)
        third = asyncio.ensure_future(queue.reserve(1))
        await asyncio.sleep(0.05)
        paused = not third.done()
        await queue.put([sample("0", [0]), sample("1", [0])])
        await queue.wait_for_samples(2)
        await queue.take(1, trainer_version=0)
        async with asyncio.timeout(5):
            await third
        return paused, queue.outstanding == 1

    paused, counted = asyncio.run(scenario())
    assert paused and counted


def test_queue_refuses_bad_bounds() -> None:
    with pytest.raises(ValueError, match="capacity_samples"):
        MessageQueue(capacity_samples=0, max_staleness=0, regenerate=lambda g: None)


def test_token_versions_round_trip() -> None:
    versions = [3, 3, 4, 4, 4, 7]
    assert encode_versions(versions) == "3*2,4*3,7*1"
    assert decode_versions(encode_versions(versions)) == versions
    assert decode_versions("") == []
    with pytest.raises(ValueError):
        decode_versions("3-2")
