"""Fakes shared by the sched tests: a two-component graph, a known-model predictor, report
builders, recorders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from dynarl.bus import ComponentReport
from dynarl.sched import HyperNode, SchedulerConfig
from dynarl.sched._predictor import effective_devices
from dynarl.sched._window import ComponentStats, WindowSet
from dynarl.types import Allocation, ComponentKind, MigrationKind

FloatArray = npt.NDArray[np.float64]

ROLLOUT = HyperNode(name="rollout", kind=ComponentKind.ROLLOUT, min_devices=2)
TRAINER = HyperNode(
    name="trainer",
    kind=ComponentKind.TRAINER,
    migration=MigrationKind.P2P,
    tp=2,
    dp_sizes=(1, 2, 4, 8),
    min_devices=2,
)
NODES = {"rollout": ROLLOUT, "trainer": TRAINER}
"""A rollout (any size from 2) and a TP-2 trainer at DP 1, 2, 4 or 8 (from 2 devices)."""
START = Allocation.of({"rollout": range(0, 12), "trainer": range(12, 16)})
"""12 rollout devices, 4 trainer devices."""


@dataclass
class PowerLawPredictor:
    """f(n) = a · n_eff^b with known parameters per component (an oracle)."""

    params: Mapping[str, tuple[float, float, float]]
    """name -> (a, b, items_per_device)."""
    observed: list[tuple[str, int, float]] = field(default_factory=list)
    errors: dict[str, tuple[float, int]] = field(default_factory=dict)

    def predict(
        self, component: str, num_devices: FloatArray, state: ComponentReport
    ) -> FloatArray:
        if component not in self.params:
            return np.zeros_like(np.asarray(num_devices, dtype=np.float64))
        a, b, q = self.params[component]
        n = np.asarray(num_devices, dtype=np.float64)
        n_eff = effective_devices(n, float(state.remaining), q)
        return np.where(n > 0, a * np.power(n_eff, b), 0.0)

    def observe(self, component: str, num_devices: int, state: ComponentReport) -> None:
        self.observed.append((component, num_devices, state.throughput))

    def refit(self) -> None:
        pass

    def prediction_error(self, component: str) -> tuple[float, int]:
        return self.errors.get(component, (0.0, 0))


def report(
    component: str,
    *,
    kind: str = "rollout",
    time: float = 10.0,
    interval_s: float = 1.0,
    utilization: tuple[float, ...] = (0.5,),
    remaining: int = 100,
    queue_depth: int = 0,
    throughput: float = 1.0,
    interruptible: bool = True,
    iteration: int = 0,
) -> ComponentReport:
    return ComponentReport(
        component=component,
        kind=kind,
        time=time,
        interval_s=interval_s,
        utilization=utilization,
        remaining=remaining,
        queue_depth=queue_depth,
        throughput=throughput,
        interruptible=interruptible,
        iteration=iteration,
    )


def stats_of(
    *reports: ComponentReport, config: SchedulerConfig | None = None
) -> dict[str, ComponentStats]:
    windows = WindowSet(config or SchedulerConfig())
    for r in reports:
        windows.observe(r)
    return windows.stats()
