"""Roles: user ``WorkerGroup`` instances hosted by a worker, one active at a time.

A role is an instance of a user's :class:`~dynarl.WorkerGroup` subclass, constructed in
the worker process as ``cls(ctx)`` with a :class:`RoleContext`. What the runtime does
with it depends on what it implements (all optional, found structurally):

- ``async start()``: build the initial state (a fresh activation, not a migration join);
- ``async run()``: the work loop, run while the role is active, cancelled when it stops;
- ``async interrupt()``: reach a batch or query boundary before the role is stopped;
- ``async sleep()`` / ``async wake()``: offload and restore, keeping the state;
- ``async close()``: free everything (teardown);
- :class:`Serving`: ``serve(item)`` and ``abort()`` (rollout, inference, reward, tools);
- :class:`Reporting`: ``metrics()`` for the worker's :class:`~dynarl.bus.WorkerMetrics`;
- :class:`Reshardable`: ``layout(devices)`` plus the migrate ``ShardedTrainer`` methods
  (P2P migration);
- :class:`Checkpointing`: ``save_state(path)`` / ``load_state(path)`` (reboot migration).

Compute runs on the worker's one :class:`ComputeThread` (``await ctx.compute(fn, ...)``),
so the worker's event loop keeps answering heartbeats and commands. Runs in the worker
process, on its event loop.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from dynarl.bus import Channel, GenerationRequest, MetaValue, Sample, WorkerGroup
from dynarl.errors import WorkerError
from dynarl.migrate import Layout, ShardedTrainer

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from dynarl.bus import ChannelBackend

__all__ = [
    "Checkpointing",
    "ComputeThread",
    "Reporting",
    "Reshardable",
    "RoleContext",
    "RoleMetrics",
    "Serving",
    "load_role_class",
    "role_path",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
C = TypeVar("C", Sample, GenerationRequest)


@dataclass(frozen=True, kw_only=True, slots=True)
class RoleMetrics:
    """A role's own account of its load (what :class:`Reporting` roles return)."""

    utilization: float
    """Utilization in [0, 1] (rollout: active KV tokens / KV capacity)."""
    queue_depth: int = 0
    """Items waiting inside the role."""
    in_flight: int = 0
    """Items running now."""
    completed: int = 0
    """Items completed since the previous call."""
    interruptible: bool = True
    """Whether the role is at an interruptible point now."""
    cache_hit_rate: float = 0.0
    """Share of prefill tokens served from a prefix cache, in [0, 1]."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.utilization <= 1.0:
            raise ValueError(f"RoleMetrics.utilization must be in [0, 1], got {self.utilization}")
        if min(self.queue_depth, self.in_flight, self.completed) < 0:
            raise ValueError("RoleMetrics counts must be >= 0")


@runtime_checkable
class Serving(Protocol):
    """A role that serves items one request at a time (the dispatcher routes to it)."""

    async def serve(self, item: GenerationRequest | Sample) -> Sample:
        """The result for ``item``; after :meth:`abort`, the partial output so far (its
        metadata ``finish`` is ``"abort"``)."""
        ...

    async def abort(self) -> None:
        """Make every pending :meth:`serve` call return its partial output now."""
        ...


@runtime_checkable
class Reporting(Protocol):
    """A role that reports its own load."""

    def metrics(self) -> RoleMetrics:
        """Load now, and items completed since the previous call (event loop)."""
        ...


@runtime_checkable
class Reshardable(ShardedTrainer, Protocol):
    """A role whose state moves by P2P migration (the migrate ``ShardedTrainer``)."""

    def layout(self, devices: tuple[int, ...]) -> Layout:
        """The layout of this role's state over ``devices`` (pure; any rank)."""
        ...


@runtime_checkable
class Checkpointing(Protocol):
    """A role whose state can be written out and read back (reboot migration)."""

    def save_state(self, path: str) -> None:
        """Write this worker's part of the state under directory ``path`` (compute thread)."""
        ...

    def load_state(self, path: str) -> None:
        """Restore the state from directory ``path``, whatever layout wrote it."""
        ...


class ComputeThread:
    """The worker's one compute thread; keeps the busy time for utilization figures."""

    def __init__(self, name: str = "dynarl-compute") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._busy_s = 0.0
        self._since: float | None = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the compute thread and return its result.

        Cancelling the caller does not stop ``fn``: the thread finishes it first.
        """
        call = functools.partial(self._timed, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def _timed(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._lock:
            self._since = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                assert self._since is not None
                self._busy_s += time.perf_counter() - self._since
                self._since = None

    def busy_seconds(self) -> float:
        """Seconds the thread has spent running work so far (the running call included)."""
        with self._lock:
            running = 0.0 if self._since is None else time.perf_counter() - self._since
            return self._busy_s + running

    def close(self) -> None:
        """Stop accepting work; queued calls are cancelled, a running one finishes."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class RoleContext:
    """What a role gets from its worker: identity, options, compute, store, channels.

    Constructed by the worker agent; roles read it, never build one.
    """

    def __init__(
        self,
        *,
        component: str,
        device: int,
        devices: tuple[int, ...],
        options: Mapping[str, MetaValue],
        epoch: int,
        compute: ComputeThread,
        store: Callable[[], Store],
        backend: ChannelBackend,
        shared: dict[str, Any] | None = None,
        cpus: tuple[int, ...] = (),
    ) -> None:
        self.component = component
        """The component this role belongs to."""
        self.device = device
        """This worker's device id (also its torch.distributed rank)."""
        self.devices = devices
        """Devices the component holds (updated when a migration commits)."""
        self.options: Mapping[str, MetaValue] = dict(options)
        """The component's options, as its spec declares them."""
        self.epoch = epoch
        """Layout epoch to name the groups of the initial layout."""
        self.shared: dict[str, Any] = shared if shared is not None else {}
        """Objects shared by every role of this worker process (one dict per worker): a
        colocated trainer leaves the weights its sleeping rollout engine loads on waking."""
        self.cpus = cpus
        """The cores this worker is pinned to (``RuntimeConfig.pin_cores``; empty when not):
        an engine the role launches runs there too."""
        self._compute = compute
        self._store = store
        self._backend = backend

    async def compute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the worker's compute thread (see :meth:`ComputeThread.run`)."""
        return await self._compute.run(fn, *args, **kwargs)

    @property
    def store(self) -> Store:
        """A client of the job's TCPStore (for groups over a ``PrefixStore``)."""
        return self._store()

    def channel(self, declared: Channel[C]) -> Channel[C]:
        """``declared`` bound to the controller's channel queues."""
        return declared.bind(self._backend)


def role_path(cls: type[WorkerGroup]) -> str:
    """The import path of a role class, ``"package.module:Class"``.

    Raises ValueError for a class that worker processes cannot import (defined in a
    function or in ``__main__``).
    """
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        raise ValueError(
            f"role class {cls.__qualname__} must be importable by worker processes: "
            "define it at the top level of a module other than __main__"
        )
    return f"{cls.__module__}:{cls.__qualname__}"


def load_role_class(path: str) -> type[WorkerGroup]:
    """Import the role class named by ``path``; raises WorkerError if it is not one."""
    module_name, _, name = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise WorkerError(f"cannot import role {path!r}: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, WorkerGroup)):
        raise WorkerError(f"role {path!r} is not a WorkerGroup subclass")
    return obj


def overrides_run(role: WorkerGroup) -> bool:
    """Whether the role has a work loop of its own."""
    return type(role).run is not WorkerGroup.run
