"""Aggregation of per-worker metrics into one report per component per interval.

A group manager keeps a :class:`MetricsBuffer` for its component: each arriving
:class:`~dynarl.bus.WorkerMetrics` is written into preallocated columns (O(1)), and at the
end of the interval :meth:`MetricsBuffer.report` folds the columns into one
:class:`~dynarl.bus.ComponentReport` with numpy, so the controller's work per interval
does not grow with the number of workers. Runs on the manager's loop (or in the
simulator); nothing here blocks or does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from dynarl.bus import ComponentReport, WorkerMetrics

__all__ = ["MetricsBuffer", "aggregate_metrics"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class MetricsBuffer:
    """Column store of one component's per-worker metrics for the current interval.

    Workers that do not report in an interval keep their last utilization, queue depth
    and in-flight count (a stale value is better than a gap for a window); completions
    count only in the interval they are reported in.
    """

    def __init__(self, component: str, kind: str, num_workers: int) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.component = component
        self.kind = kind
        self._completed_total = 0
        self._last_time = 0.0
        self.resize(num_workers)

    @property
    def num_workers(self) -> int:
        """Workers the buffer has columns for."""
        return int(self._utilization.shape[0])

    def resize(self, num_workers: int) -> None:
        """Start over with ``num_workers`` columns (after the component was resized)."""
        self._utilization: FloatArray = np.zeros(num_workers)
        self._queue: IntArray = np.zeros(num_workers, dtype=np.int64)
        self._in_flight: IntArray = np.zeros(num_workers, dtype=np.int64)
        self._completed: IntArray = np.zeros(num_workers, dtype=np.int64)
        self._interruptible = np.ones(num_workers, dtype=bool)

    def add(self, metrics: WorkerMetrics) -> None:
        """Record one worker's metrics; raises ValueError for a foreign or unknown worker."""
        if metrics.component != self.component:
            raise ValueError(f"metrics of {metrics.component!r} sent to {self.component!r}")
        w = metrics.worker
        if not 0 <= w < self.num_workers:
            raise ValueError(f"{self.component!r} has no worker {w} ({self.num_workers} known)")
        self._utilization[w] = min(max(metrics.utilization, 0.0), 1.0)
        self._queue[w] = metrics.queue_depth
        self._in_flight[w] = metrics.in_flight
        self._completed[w] += metrics.completed
        self._interruptible[w] = metrics.interruptible
        self._last_time = max(self._last_time, metrics.time)

    def add_columns(
        self,
        workers: IntArray,
        utilization: FloatArray,
        *,
        queue_depth: IntArray | None = None,
        completed: IntArray | None = None,
        in_flight: IntArray | None = None,
        interruptible: npt.NDArray[np.bool_] | None = None,
    ) -> None:
        """Record many workers at once (the simulator's and the benchmark's path)."""
        self._utilization[workers] = np.clip(utilization, 0.0, 1.0)
        if queue_depth is not None:
            self._queue[workers] = queue_depth
        if in_flight is not None:
            self._in_flight[workers] = in_flight
        if completed is not None:
            done = np.bincount(workers, weights=completed, minlength=self.num_workers)
            self._completed += done.astype(np.int64)
        if interruptible is not None:
            self._interruptible[workers] = interruptible

    def new_iteration(self) -> None:
        """Zero the completed-in-this-iteration count (at an iteration boundary)."""
        self._completed_total = 0

    def report(
        self,
        *,
        time: float | None = None,
        interval_s: float,
        remaining: int | None = None,
        iteration: int = 0,
    ) -> ComponentReport:
        """Fold the interval into one report and start the next interval.

        ``remaining`` is the items of the iteration not yet completed when the manager
        knows the iteration's size; otherwise queued plus in-flight items stand in.
        Raises ValueError for a non-positive interval.
        """
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        done = int(self._completed.sum())
        self._completed_total += done
        queue = int(self._queue.sum())
        report = ComponentReport(
            component=self.component,
            kind=self.kind,
            time=self._last_time if time is None else time,
            interval_s=interval_s,
            utilization=tuple(self._utilization.tolist()),
            queue_depth=queue,
            throughput=done / interval_s,
            completed=self._completed_total,
            remaining=queue + int(self._in_flight.sum()) if remaining is None else remaining,
            interruptible=bool(self._interruptible.all()),
            iteration=iteration,
        )
        self._completed[:] = 0
        return report


def aggregate_metrics(
    component: str,
    kind: str,
    metrics: Iterable[WorkerMetrics],
    *,
    num_workers: int,
    interval_s: float,
    remaining: int | None = None,
    iteration: int = 0,
) -> ComponentReport:
    """One report from one interval's worker metrics (a one-shot :class:`MetricsBuffer`).

    Raises ValueError as :meth:`MetricsBuffer.add` and :meth:`MetricsBuffer.report` do.
    """
    buffer = MetricsBuffer(component, kind, num_workers)
    for m in metrics:
        buffer.add(m)
    return buffer.report(interval_s=interval_s, remaining=remaining, iteration=iteration)
