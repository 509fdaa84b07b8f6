"""Request scheduling inside one engine: a priority queue with a starvation bound.

The default policy orders waiting requests by completed tool calls (descending), then
reusable cached prefix (descending), then arrival (Algorithm 2): later turns of an
episode, closer to done and with their prefix still cached, go first. Aging bounds
starvation as a count: no request is overtaken by more than ``max_overtakes`` later
arrivals. A request's overtake count is the number of later arrivals dispatched while it
waits; it is largest for the oldest waiting request, so the queue only has to watch the
oldest: once that one has been overtaken ``max_overtakes`` times it goes next; the queue
counts every dispatched request's overtakes and keeps the largest
(:attr:`RequestQueue.max_overtakes_seen`), so the bound can be checked. FIFO,
least-attained-service (Autellix's PLAS when the attained service is the episode's) and a
tool-aware multi-level feedback queue (:class:`ToolMlfqPolicy`) are alternative
:class:`RequestPolicy` s. Push, pop and re-keying
(when cache eviction shrinks a reusable prefix) are O(log n); removal is O(1). Lives in
the engine's loop; not thread-safe.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

__all__ = [
    "FifoPolicy",
    "LeastAttainedServicePolicy",
    "PriorityPolicy",
    "QueuedRequest",
    "RequestPolicy",
    "RequestQueue",
    "ToolMlfqPolicy",
]

_WAITING, _DISPATCHED, _REMOVED = 0, 1, 2


@dataclass(frozen=True, kw_only=True, slots=True)
class QueuedRequest:
    """One request waiting in an engine's queue."""

    request_id: str
    """Unique id of the request (one turn of an episode)."""
    tool_calls: int = 0
    """k_r: tool calls its episode has completed."""
    cached_prefix: int = 0
    """m_r: tokens of its prompt the engine's prefix cache still holds."""
    attained_service: float = 0.0
    """Tokens its episode has generated so far (for least-attained-service)."""
    tool_ok: bool = True
    """Whether its episode's last tool call succeeded (True before any)."""
    seq: int = -1
    """Arrival order in this queue (set by the queue)."""


@runtime_checkable
class RequestPolicy(Protocol):
    """Orders waiting requests: smaller keys go first; arrival breaks ties."""

    @property
    def name(self) -> str:
        """Short name (for logs and configs)."""
        ...

    def key(self, request: QueuedRequest) -> tuple[float, ...]:
        """The sort key of ``request``."""
        ...


@dataclass(frozen=True, slots=True)
class PriorityPolicy:
    """(completed tool calls desc, reusable cached prefix desc) — DynaRL's Algorithm 2."""

    name: str = "priority"

    def key(self, request: QueuedRequest) -> tuple[float, ...]:
        """``(-tool_calls, -cached_prefix)``."""
        return (-request.tool_calls, -request.cached_prefix)


@dataclass(frozen=True, slots=True)
class FifoPolicy:
    """Arrival order (what SGLang and vLLM do by default)."""

    name: str = "fifo"

    def key(self, request: QueuedRequest) -> tuple[float, ...]:
        """The empty key: arrival decides."""
        return ()


@dataclass(frozen=True, slots=True)
class LeastAttainedServicePolicy:
    """Least tokens generated so far first."""

    name: str = "las"

    def key(self, request: QueuedRequest) -> tuple[float, ...]:
        """``(attained_service,)``."""
        return (request.attained_service,)


@dataclass(frozen=True, slots=True)
class ToolMlfqPolicy:
    """A multi-level feedback queue over episodes, moved at turn boundaries by their tool
    calls' outcomes (after Libra's C-MLFQ). The exact rule:

    * the base level is set by the episode's attained service ``a``:
      ``min(levels - 1, floor(log2(1 + a / quantum)))`` — level k holds episodes that have
      generated ``[quantum·(2^k − 1), quantum·(2^(k+1) − 1))`` tokens;
    * at each turn boundary the last tool call moves the episode one level: a failed call
      down (it will likely retry and run long), a successful one up (closer to done);
      a first turn stays at its base level;
    * lower levels run first; arrival order within a level.
    """

    quantum: float = 256.0
    """Tokens of attained service that fill level 0."""
    levels: int = 4
    """Number of levels."""
    name: str = "cmlfq"

    def __post_init__(self) -> None:
        if self.quantum <= 0 or self.levels < 1:
            raise ValueError(
                f"ToolMlfqPolicy needs quantum > 0 and levels >= 1, got {self.quantum}, "
                f"{self.levels}"
            )

    def level(self, request: QueuedRequest) -> int:
        """The request's level (see the class docstring)."""
        base = min(self.levels - 1, int(math.log2(1.0 + request.attained_service / self.quantum)))
        if request.tool_calls == 0:
            return base
        moved = base - 1 if request.tool_ok else base + 1
        return max(0, min(self.levels - 1, moved))

    def key(self, request: QueuedRequest) -> tuple[float, ...]:
        """``(level,)``."""
        return (float(self.level(request)),)


class RequestQueue:
    """Waiting requests of one engine (see the module docstring).

    Raises ValueError for a duplicate or unknown request id, IndexError when popping
    an empty queue.
    """

    def __init__(
        self, policy: RequestPolicy | None = None, *, max_overtakes: int | None = 64
    ) -> None:
        if max_overtakes is not None and max_overtakes < 0:
            raise ValueError(f"max_overtakes must be >= 0 or None, got {max_overtakes}")
        self.policy: RequestPolicy = policy or PriorityPolicy()
        self.max_overtakes = max_overtakes
        self._requests: dict[int, QueuedRequest] = {}
        self._seq_of: dict[str, int] = {}
        self._state: dict[int, int] = {}
        self._version: dict[int, int] = {}
        self._heap: list[tuple[tuple[float, ...], int, int]] = []
        self._arrivals: deque[int] = deque()
        self._next_seq = 0
        self._dispatched = 0
        self._removed_below_head = 0
        self._dispatched_seqs: list[int] = []
        """Arrival orders of the dispatched requests not older than the oldest waiting one
        (sorted): what a later dispatch can have been overtaken by."""
        self.max_overtakes_seen = 0
        """The most overtakes any dispatched request suffered (later arrivals dispatched
        while it waited): never above ``max_overtakes``."""

    def __len__(self) -> int:
        return len(self._seq_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seq_of

    def __iter__(self) -> Iterator[QueuedRequest]:
        """Waiting requests in arrival order."""
        return iter(sorted((self._requests[s] for s in self._seq_of.values()), key=lambda r: r.seq))

    def push(self, request: QueuedRequest) -> QueuedRequest:
        """Enqueue ``request`` (a new arrival); returns it with its arrival order set."""
        if request.request_id in self._seq_of:
            raise ValueError(f"request {request.request_id!r} is already queued")
        seq = self._next_seq
        self._next_seq += 1
        queued = replace(request, seq=seq)
        self._requests[seq] = queued
        self._seq_of[request.request_id] = seq
        self._state[seq] = _WAITING
        self._version[seq] = 0
        self._arrivals.append(seq)
        heapq.heappush(self._heap, (self.policy.key(queued), seq, 0))
        return queued

    def pop(self) -> QueuedRequest:
        """Dispatch the next request."""
        self._advance_head()
        if not self._seq_of:
            raise IndexError("pop from an empty RequestQueue")
        oldest = self._arrivals[0]
        if self.max_overtakes is not None and self._overtaken_oldest() >= self.max_overtakes:
            return self._finish(oldest, _DISPATCHED)
        while True:
            _, seq, version = heapq.heappop(self._heap)
            if self._state.get(seq) == _WAITING and self._version[seq] == version:
                return self._finish(seq, _DISPATCHED)

    def pop_batch(self, max_items: int) -> list[QueuedRequest]:
        """Dispatch up to ``max_items`` requests, in order."""
        return [self.pop() for _ in range(min(max_items, len(self)))]

    def peek(self) -> QueuedRequest | None:
        """The request :meth:`pop` would return, without dispatching it."""
        self._advance_head()
        if not self._seq_of:
            return None
        if self.max_overtakes is not None and self._overtaken_oldest() >= self.max_overtakes:
            return self._requests[self._arrivals[0]]
        while True:
            _, seq, version = self._heap[0]
            if self._state.get(seq) == _WAITING and self._version[seq] == version:
                return self._requests[seq]
            heapq.heappop(self._heap)

    def remove(self, request_id: str) -> QueuedRequest:
        """Take a request out without dispatching it (abort, migration)."""
        if request_id not in self._seq_of:
            raise ValueError(f"request {request_id!r} is not queued")
        return self._finish(self._seq_of[request_id], _REMOVED)

    def update(
        self,
        request_id: str,
        *,
        cached_prefix: int | None = None,
        tool_calls: int | None = None,
        attained_service: float | None = None,
    ) -> QueuedRequest:
        """Change a waiting request's fields and re-key it (it keeps its arrival order).
        Also the way to re-key after the policy's inputs changed elsewhere."""
        if request_id not in self._seq_of:
            raise ValueError(f"request {request_id!r} is not queued")
        seq = self._seq_of[request_id]
        current = self._requests[seq]
        changed = replace(
            current,
            cached_prefix=current.cached_prefix if cached_prefix is None else cached_prefix,
            tool_calls=current.tool_calls if tool_calls is None else tool_calls,
            attained_service=(
                current.attained_service if attained_service is None else attained_service
            ),
        )
        self._requests[seq] = changed
        if self.policy.key(changed) != self.policy.key(current):
            self._version[seq] += 1
            heapq.heappush(self._heap, (self.policy.key(changed), seq, self._version[seq]))
            self._compact()
        return changed

    def evict(self, cached_prefix: Mapping[str, int]) -> None:
        """Cache eviction changed these requests' reusable prefixes: re-key them."""
        for request_id, tokens in cached_prefix.items():
            if request_id in self._seq_of:
                self.update(request_id, cached_prefix=tokens)

    def _finish(self, seq: int, state: int) -> QueuedRequest:
        request = self._requests.pop(seq)
        del self._seq_of[request.request_id]
        del self._version[seq]
        self._state[seq] = state
        if state == _DISPATCHED:
            self._dispatched += 1
            later = len(self._dispatched_seqs) - bisect.bisect_right(self._dispatched_seqs, seq)
            self.max_overtakes_seen = max(self.max_overtakes_seen, later)
            bisect.insort(self._dispatched_seqs, seq)
        self._compact()
        return request

    def _advance_head(self) -> None:
        while self._arrivals and self._state[self._arrivals[0]] != _WAITING:
            seq = self._arrivals.popleft()
            if self._state.pop(seq) == _REMOVED:
                self._removed_below_head += 1
        head = self._arrivals[0] if self._arrivals else self._next_seq
        below = bisect.bisect_left(self._dispatched_seqs, head)
        if below:
            del self._dispatched_seqs[:below]

    def _overtaken_oldest(self) -> int:
        """Later arrivals dispatched while the oldest waiting request waited."""
        head = self._arrivals[0]
        return self._dispatched - (head - self._removed_below_head)

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._seq_of) + 64:
            self._heap = [
                (self.policy.key(self._requests[seq]), seq, self._version[seq])
                for seq in self._seq_of.values()
            ]
            heapq.heapify(self._heap)
