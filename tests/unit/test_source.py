"""The sample source: deterministic, seekable, every item once per epoch, ids unique."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynarl.runtime.durable._source import SampleSource, SourceConfig, permute


@given(size=st.integers(1, 300), key=st.integers(0, 2**64 - 1))
def test_permute_is_a_bijection(size: int, key: int) -> None:
    assert sorted(permute(i, size, key) for i in range(size)) == list(range(size))


@given(
    seed=st.integers(0, 2**32),
    num_items=st.integers(1, 40),
    group_size=st.integers(1, 4),
    cursor=st.integers(0, 200),
)
def test_a_source_resumed_at_a_cursor_issues_the_same_tickets(
    seed: int, num_items: int, group_size: int, cursor: int
) -> None:
    config = SourceConfig(seed=seed, num_items=num_items, group_size=group_size)
    straight = SampleSource(config).take(cursor + 30)
    resumed = SampleSource(config, cursor=cursor)
    assert resumed.take(30) == straight[cursor:]
    assert resumed.cursor == cursor + 30
    assert len({t.sample_id for t in straight}) == len(straight)


def test_each_epoch_visits_every_item_once_per_group_member() -> None:
    config = SourceConfig(seed=7, num_items=13, group_size=3)
    tickets = SampleSource(config).take(13 * 3 * 2)
    for epoch in (0, 1):
        counts = Counter(t.item for t in tickets if t.epoch == epoch)
        assert counts == dict.fromkeys(range(13), 3)
    first, second = ([t.item for t in tickets if t.epoch == e and t.member == 0] for e in (0, 1))
    assert first != second  # a fresh order each epoch
    group = tickets[:3]
    assert len({t.prompt_id for t in group}) == 1 and [t.member for t in group] == [0, 1, 2]
    assert len({t.seed for t in tickets}) == len(tickets)


def test_seeds_change_the_order_and_shuffle_off_keeps_it() -> None:
    def items(config: SourceConfig) -> list[int]:
        return [t.item for t in SampleSource(config).take(50)]

    assert items(SourceConfig(seed=1, num_items=50)) != items(SourceConfig(seed=2, num_items=50))
    assert items(SourceConfig(seed=1, num_items=50, shuffle=False)) == list(range(50))
    ticket = SampleSource(SourceConfig(seed=1, num_items=50)).ticket(10**12)
    assert ticket.epoch == 10**12 // 50 and 0 <= ticket.item < 50


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="num_items"):
        SourceConfig(seed=0, num_items=0)
    with pytest.raises(ValueError, match="group_size"):
        SourceConfig(seed=0, num_items=1, group_size=0)
    source = SampleSource(SourceConfig(seed=0, num_items=3))
    with pytest.raises(ValueError, match="cursor"):
        source.seek(-1)
    with pytest.raises(ValueError, match="num_samples"):
        source.take(-1)
    with pytest.raises(ValueError, match="outside"):
        permute(3, 3, 0)
