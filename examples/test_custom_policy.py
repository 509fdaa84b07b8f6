"""Property tests of the policies in ``custom_policy.py``, written with ``dynarl.testing``'s
strategies and nothing else of dynarl's test suite.

Run: ``.venv/bin/python -m pytest examples/test_custom_policy.py`` (a few seconds).
"""

from __future__ import annotations

from custom_policy import CacheFirstPolicy, WarmupPolicy
from hypothesis import given, settings
from hypothesis import strategies as st

from dynarl.sched import DynamicScheduleContext, QueuedRequest, RequestQueue, build_policy
from dynarl.testing import queued_requests, schedule_contexts


@settings(max_examples=200, deadline=None)
@given(queued_requests(max_size=40), st.integers(0, 8))
def test_every_request_is_served_once_and_none_starves(
    requests: list[QueuedRequest], max_overtakes: int
) -> None:
    queue = RequestQueue(CacheFirstPolicy(), max_overtakes=max_overtakes)
    for request in requests:
        queue.push(request)
    arrival = {r.request_id: i for i, r in enumerate(requests)}
    served = [queue.pop().request_id for _ in requests]
    assert sorted(served) == sorted(arrival)
    for position, request_id in enumerate(served):
        overtaken_by = sum(1 for other in served[:position] if arrival[other] > arrival[request_id])
        assert overtaken_by <= max_overtakes


@settings(max_examples=200, deadline=None)
@given(queued_requests(max_size=40))
def test_without_aging_the_largest_cached_prefix_goes_first(requests: list[QueuedRequest]) -> None:
    queue = RequestQueue(CacheFirstPolicy(), max_overtakes=None)
    for request in requests:
        queue.push(request)
    served = [queue.pop() for _ in requests]
    prefixes = [r.cached_prefix for r in served]
    assert prefixes == sorted(prefixes, reverse=True)


@settings(max_examples=200, deadline=None)
@given(schedule_contexts(), st.integers(0, 5), st.integers(0, 20), st.booleans())
def test_the_warmup_policy(
    ctx: DynamicScheduleContext, warmup: int, step: int, active: bool
) -> None:
    policy = build_policy("warmup", warmup_steps=warmup)
    assert isinstance(policy, WarmupPolicy)
    assert 0 <= policy.deactivate_wait_samples(ctx) <= ctx.step_required_samples
    if step < warmup:
        assert not policy.should_activate_after_step(step, active, ctx)
    assert policy.should_deactivate(step, active, ctx) == active
