"""Model-based: RequestQueue against a heapq model, with cache-eviction steps.

The model keeps every waiting request with its overtake count (later arrivals dispatched
while it waited) and picks the next request with heapq over (policy key, arrival); when
the oldest waiting request has reached the bound, it goes instead. After every step:
nothing is lost or duplicated, the queue's order equals the model's, no waiting
request has been overtaken more than the bound, and the queue's record of the most
overtakes a dispatched request suffered equals the model's. One machine runs against every policy
and several bounds (a conformance factory).
"""

from __future__ import annotations

import heapq
from dataclasses import replace

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from dynarl.sched import FifoPolicy, PriorityPolicy, QueuedRequest, RequestPolicy, RequestQueue
from dynarl.sched._requests import LeastAttainedServicePolicy, ToolMlfqPolicy


def machine_for(policy: RequestPolicy, bound: int | None) -> type[RuleBasedStateMachine]:
    class QueueMachine(RuleBasedStateMachine):
        ids = Bundle("ids")

        def __init__(self) -> None:
            super().__init__()
            self.queue = RequestQueue(policy, max_overtakes=bound)
            self.waiting: dict[str, QueuedRequest] = {}
            self.overtaken: dict[str, int] = {}
            self.pushed: set[str] = set()
            self.gone: list[str] = []
            self.counter = 0
            self.most_overtaken = 0

        def model_next(self) -> str:
            oldest = min(self.waiting.values(), key=lambda r: r.seq)
            if bound is not None and self.overtaken[oldest.request_id] >= bound:
                return oldest.request_id
            heap = [(policy.key(r), r.seq, r.request_id) for r in self.waiting.values()]
            heapq.heapify(heap)
            return heap[0][2]

        def dispatch(self, request_id: str) -> None:
            seq = self.waiting.pop(request_id).seq
            for other in self.waiting.values():
                if other.seq < seq:
                    self.overtaken[other.request_id] += 1
            self.most_overtaken = max(self.most_overtaken, self.overtaken.pop(request_id))
            self.gone.append(request_id)

        @rule(
            target=ids,
            tool_calls=st.integers(0, 4),
            prefix=st.integers(0, 3),
            service=st.integers(0, 5),
            ok=st.booleans(),
        )
        def push(self, tool_calls: int, prefix: int, service: int, ok: bool) -> str:
            request_id = f"r{self.counter}"
            self.counter += 1
            queued = self.queue.push(
                QueuedRequest(
                    request_id=request_id,
                    tool_calls=tool_calls,
                    cached_prefix=prefix * 100,
                    attained_service=float(service),
                    tool_ok=ok,
                )
            )
            self.waiting[request_id] = queued
            self.overtaken[request_id] = 0
            self.pushed.add(request_id)
            return request_id

        @precondition(lambda self: self.waiting)
        @rule()
        def pop(self) -> None:
            expected = self.model_next()
            assert self.queue.peek() is not None
            assert self.queue.peek().request_id == expected  # type: ignore[union-attr]
            got = self.queue.pop()
            assert got.request_id == expected
            self.dispatch(expected)

        @rule(n=st.integers(1, 4))
        def pop_batch(self, n: int) -> None:
            expected = []
            for _ in range(min(n, len(self.waiting))):
                nxt = self.model_next()
                expected.append(nxt)
                self.dispatch(nxt)
            assert [r.request_id for r in self.queue.pop_batch(n)] == expected

        @rule(request_id=consumes(ids))
        def remove(self, request_id: str) -> None:
            if request_id in self.waiting:
                assert self.queue.remove(request_id).request_id == request_id
                del self.waiting[request_id]
                del self.overtaken[request_id]
                self.gone.append(request_id)
            else:
                with pytest.raises(ValueError, match="not queued"):
                    self.queue.remove(request_id)

        @rule(request_id=ids, prefix=st.integers(0, 3))
        def evict(self, request_id: str, prefix: int) -> None:
            self.queue.evict({request_id: prefix * 100})
            if request_id in self.waiting:
                current = self.waiting[request_id]
                self.waiting[request_id] = replace(current, cached_prefix=prefix * 100)

        @rule(request_id=ids, tool_calls=st.integers(0, 4))
        def turn_done(self, request_id: str, tool_calls: int) -> None:
            if request_id in self.waiting:
                self.queue.update(request_id, tool_calls=tool_calls)
                current = self.waiting[request_id]
                self.waiting[request_id] = replace(current, tool_calls=tool_calls)

        @invariant()
        def nothing_lost_or_duplicated(self) -> None:
            assert len(self.queue) == len(self.waiting)
            assert {r.request_id for r in self.queue} == set(self.waiting)
            assert len(self.gone) == len(set(self.gone))
            assert set(self.gone) | set(self.waiting) == self.pushed
            assert not set(self.gone) & set(self.waiting)

        @invariant()
        def overtaking_is_bounded(self) -> None:
            if bound is not None:
                assert all(count <= bound for count in self.overtaken.values())
                assert self.queue.max_overtakes_seen <= bound
            assert self.queue.max_overtakes_seen == self.most_overtaken

    QueueMachine.__name__ = f"QueueMachine_{policy.name}_{bound}"
    return QueueMachine


POLICIES: list[RequestPolicy] = [PriorityPolicy(), FifoPolicy(), LeastAttainedServicePolicy()]

TestPriorityBound0 = machine_for(PriorityPolicy(), 0).TestCase
TestPriorityBound2 = machine_for(PriorityPolicy(), 2).TestCase
TestPriorityUnbounded = machine_for(PriorityPolicy(), None).TestCase
TestFifoBound1 = machine_for(FifoPolicy(), 1).TestCase
TestLasBound3 = machine_for(LeastAttainedServicePolicy(), 3).TestCase
TestToolMlfqBound2 = machine_for(ToolMlfqPolicy(quantum=1.0, levels=3), 2).TestCase
TestToolMlfqUnbounded = machine_for(ToolMlfqPolicy(quantum=1.0, levels=3), None).TestCase
