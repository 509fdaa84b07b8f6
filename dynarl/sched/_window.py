"""Stage 1: sliding windows over component reports, and donor detection (Algorithm 1).

For every component the :class:`WindowSet` keeps, per worker, the time since which its
utilization has stayed strictly below U_low (infinite while it is above), and a window of
component figures (utilization, queue depth, throughput, progress). A component is a
donor when at least θ of its workers have stayed below U_low for T seconds. Updating is
O(workers) with numpy per report; :func:`detect_donors` is a pure function of the
snapshot :meth:`WindowSet.stats` returns. Runs in the scheduler's loop.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dynarl.bus import ComponentReport
from dynarl.sched._sched_config import SchedulerConfig

__all__ = ["ComponentStats", "DonorSignal", "WindowSet", "detect_donors"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ComponentStats:
    """What the windows say about one component at its latest report."""

    component: str
    """Component name."""
    kind: str
    """A ``dynarl.ComponentKind`` value."""
    time: float
    """Time of the latest report, seconds."""
    num_workers: int
    """Workers in the latest report."""
    idle_fraction: float
    """Fraction of workers below U_low for at least T seconds now."""
    mean_utilization: float
    """Time-weighted mean utilization over the stats window."""
    queue_depth: int
    """Items queued at the latest report."""
    throughput: float
    """Time-weighted mean throughput over the stats window, items per second."""
    completed: int
    """Items of the iteration completed at the latest report."""
    remaining: int
    """Items of the iteration remaining at the latest report."""
    interruptible: bool
    """Whether the component is at an interruptible point now."""
    iteration: int
    """Iteration of the latest report."""
    latest: ComponentReport
    """The latest report itself (the predictor's view of the component's state)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DonorSignal:
    """A component Stage 1 found over-provisioned."""

    component: str
    """Component name."""
    idle_fraction: float
    """Fraction of its workers idle for at least T seconds."""
    mean_utilization: float
    """Its mean utilization over the window."""


class _Window:
    __slots__ = ("below_since", "history", "latest")

    def __init__(self, num_workers: int, latest: ComponentReport) -> None:
        self.below_since = np.full(num_workers, np.inf)
        self.history: deque[tuple[float, float, float, float]] = deque()
        self.latest = latest


class WindowSet:
    """Per-component windows of reports (the state Stage 1 reads)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._windows: dict[str, _Window] = {}

    def observe(self, report: ComponentReport) -> None:
        """Fold one report into its component's window.

        A report whose worker count differs from the previous one (the component was
        resized) restarts the per-worker idle clocks, so a freshly resized component must
        again stay idle for T seconds before it can donate. Raises ValueError for a
        report older than the component's latest.
        """
        util = np.fromiter(report.utilization, dtype=np.float64, count=len(report.utilization))
        window = self._windows.get(report.component)
        if window is None or window.below_since.shape[0] != util.shape[0]:
            if window is not None:
                logger.info(
                    "%s resized to %d workers: idle clocks restart", report.component, util.shape[0]
                )
            window = _Window(util.shape[0], report)
            self._windows[report.component] = window
        elif report.time < window.latest.time:
            raise ValueError(
                f"report for {report.component!r} at {report.time} is older than "
                f"the latest at {window.latest.time}"
            )
        below = util < self._config.util_low
        start = report.time - report.interval_s
        window.below_since = np.where(below, np.minimum(window.below_since, start), np.inf)
        mean = float(util.mean()) if util.size else 0.0
        window.history.append((report.time, report.interval_s, mean, report.throughput))
        horizon = report.time - self._config.stats_window_s
        while window.history and window.history[0][0] < horizon:
            window.history.popleft()
        window.latest = report

    def forget(self, component: str) -> None:
        """Drop a component's window (it was removed, or its workers were replaced)."""
        self._windows.pop(component, None)

    def stats(self) -> dict[str, ComponentStats]:
        """A snapshot of every component's window."""
        return {name: self._stats(name, w) for name, w in sorted(self._windows.items())}

    def _stats(self, name: str, window: _Window) -> ComponentStats:
        latest = window.latest
        n = window.below_since.shape[0]
        threshold = latest.time - self._config.donor_window_s
        idle = int(np.count_nonzero(window.below_since <= threshold)) if n else 0
        weights = np.array([h[1] for h in window.history])
        total = float(weights.sum())
        utils = np.array([h[2] for h in window.history])
        rates = np.array([h[3] for h in window.history])
        return ComponentStats(
            component=name,
            kind=latest.kind,
            time=latest.time,
            num_workers=n,
            idle_fraction=idle / n if n else 0.0,
            mean_utilization=float((utils * weights).sum() / total) if total else 0.0,
            queue_depth=latest.queue_depth,
            throughput=float((rates * weights).sum() / total) if total else 0.0,
            completed=latest.completed,
            remaining=latest.remaining,
            interruptible=latest.interruptible,
            iteration=latest.iteration,
            latest=latest,
        )


def detect_donors(
    stats: Mapping[str, ComponentStats], config: SchedulerConfig
) -> tuple[DonorSignal, ...]:
    """Components whose idle fraction reaches θ, most idle first (pure).

    Only components at an interruptible point with at least one worker qualify.
    """
    donors = [
        DonorSignal(
            component=s.component,
            idle_fraction=s.idle_fraction,
            mean_utilization=s.mean_utilization,
        )
        for s in stats.values()
        if s.num_workers > 0 and s.interruptible and s.idle_fraction >= config.donor_fraction
    ]
    donors.sort(key=lambda d: (-d.idle_fraction, d.mean_utilization, d.component))
    return tuple(donors)
