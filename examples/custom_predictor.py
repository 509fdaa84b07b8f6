"""A throughput predictor of your own, plugged into dynarl's scheduler.

The scheduler asks a predictor one question: how many items per second would a component
process on n devices, in its current state? dynarl's default
(:class:`dynarl.sched.RegressionPredictor`) fits a power law with a tail model. Here is a
different one, written against the :class:`dynarl.sched.ThroughputPredictor` protocol:
Amdahl's law per component, ``f(n) = r · n / (1 + s · (n − 1))``, with the per-device
rate ``r`` learned online from the reports (an exponential moving average of measured
throughput per device, corrected for the serial fraction) and the serial fraction ``s``
given. A rollout engine with few requests left cannot use many devices, so the rollout's
``n`` is capped by the requests remaining.

The script drives the scheduler in virtual time through a rollout tail twice — with this
predictor and with the default — and prints the moves each one decides. In a real job,
pass it to ``dynarl.Job(components, config, predictor=AmdahlPredictor(...))``.

Run: ``.venv/bin/python examples/custom_predictor.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from dynarl.bus import ComponentReport, DecisionRecord
from dynarl.sched import (
    ComponentProfile,
    HyperNode,
    ManualClock,
    MoveOutcome,
    ProfilePoint,
    RegressionPredictor,
    Scheduler,
    SchedulerConfig,
    StaticMigrationCost,
    ThroughputPredictor,
)
from dynarl.types import Allocation, ComponentKind, MigrationKind

FloatArray = npt.NDArray[np.float64]


@dataclass
class AmdahlPredictor:
    """Amdahl's law per component, its per-device rate learned from reports."""

    serial_fraction: Mapping[str, float]
    """s per component (0: perfectly parallel)."""
    rate: dict[str, float] = field(default_factory=dict)
    """r per component: items per second of one device (learned)."""
    requests_per_device: Mapping[str, float] = field(default_factory=dict)
    """Items one device keeps busy; caps the devices a tail can use (0: no cap)."""
    smoothing: float = 0.3
    """Weight of a new measurement in the moving average of r."""
    errors: dict[str, list[float]] = field(default_factory=dict)
    """Relative errors of the last 32 predictions per component (for the ledger)."""

    def _speedup(self, component: str, n: FloatArray) -> FloatArray:
        s = self.serial_fraction.get(component, 0.0)
        return n / (1.0 + s * np.maximum(n - 1.0, 0.0))

    def predict(
        self, component: str, num_devices: FloatArray, state: ComponentReport
    ) -> FloatArray:
        """r · speedup(n), with n capped by the work left for a tail (0: unknown component)."""
        n = np.asarray(num_devices, dtype=np.float64)
        per = self.requests_per_device.get(component, 0.0)
        if per > 0:
            n = np.minimum(n, max(state.remaining / per, 1.0))
        return self.rate.get(component, 0.0) * self._speedup(component, n)

    def observe(self, component: str, num_devices: int, state: ComponentReport) -> None:
        """Record the error of the current prediction, then update r."""
        if num_devices <= 0 or state.throughput <= 0:
            return
        if component in self.rate:
            predicted = float(self.predict(component, np.array([float(num_devices)]), state)[0])
            error = abs(predicted - state.throughput) / state.throughput
            self.errors.setdefault(component, []).append(error)
            del self.errors[component][:-32]
        n = np.array([float(num_devices)])
        per = self.requests_per_device.get(component, 0.0)
        if per > 0:
            n = np.minimum(n, max(state.remaining / per, 1.0))
        measured = state.throughput / float(self._speedup(component, n)[0])
        old = self.rate.get(component, measured)
        self.rate[component] = (1 - self.smoothing) * old + self.smoothing * measured

    def refit(self) -> None:
        """Nothing to fit in batch: observe() already learned."""

    def prediction_error(self, component: str) -> tuple[float, int]:
        """Median relative error of recent predictions, and how many there are."""
        errors = self.errors.get(component, [])
        return (float(np.median(errors)), len(errors)) if errors else (0.0, 0)


def run(predictor: ThroughputPredictor) -> list[str]:
    """A rollout tail on 16 devices in virtual time; the moves ``predictor`` leads to."""
    nodes = {
        "rollout": HyperNode(name="rollout", kind=ComponentKind.ROLLOUT, min_devices=2),
        "trainer": HyperNode(
            name="trainer", kind=ComponentKind.TRAINER, migration=MigrationKind.P2P, tp=2
        ),
    }
    clock = ManualClock()
    scheduler = Scheduler(
        graph=nodes,
        allocation=Allocation.of({"rollout": range(12), "trainer": range(12, 16)}),
        predictor=predictor,
        cost=StaticMigrationCost(seconds={MigrationKind.WORKLOAD: 4.0, MigrationKind.P2P: 1.0}),
        clock=clock,
        config=SchedulerConfig(num_devices_per_node=8, min_move_interval_s=5.0),
    )
    remaining = 400
    for _ in range(30):
        t = clock.advance(1.0)
        n_roll, n_train = (
            scheduler.allocation.count("rollout"),
            scheduler.allocation.count("trainer"),
        )
        done = min(remaining - 6, int(20 * min(n_roll, remaining / 4)))
        remaining -= max(done, 0)
        busy = min(1.0, remaining / (4 * n_roll))
        reports = [
            ComponentReport(
                component="rollout",
                kind="rollout",
                time=t,
                interval_s=1.0,
                utilization=(busy,) * n_roll,
                remaining=remaining,
                throughput=float(max(done, 0)),
            ),
            ComponentReport(
                component="trainer",
                kind="trainer",
                time=t,
                interval_s=1.0,
                utilization=(1.0,) * (n_train // 2),
                remaining=2000,
                queue_depth=64,
                throughput=2.0 * n_train,
            ),
        ]
        for report in reports:
            for command in scheduler.handle(report):
                # The move takes effect at once here; a real job reports when it ends.
                outcome = MoveOutcome(
                    decision_id=command.decision_id, ok=True, allocation=command.new_allocation
                )
                scheduler.handle(outcome)
    return [
        f"t={r.time:4.0f}s {r.old_allocation} -> {r.new_allocation}: {r.reason}"
        for r in scheduler.ledger.query(kind="decision", committed=True)
        if isinstance(r, DecisionRecord)
    ]


def main() -> None:
    amdahl = AmdahlPredictor(
        serial_fraction={"rollout": 0.02, "trainer": 0.3},
        rate={"rollout": 20.0, "trainer": 2.0},
        requests_per_device={"rollout": 4.0},
    )
    assert isinstance(amdahl, ThroughputPredictor)  # the protocol is runtime-checkable
    default = RegressionPredictor(
        {
            "rollout": ComponentProfile(
                points=tuple(ProfilePoint(num_devices=n, throughput=20.0 * n) for n in (1, 4, 16)),
                items_per_device=4.0,
            ),
            "trainer": ComponentProfile(
                points=tuple(ProfilePoint(num_devices=n, throughput=2.0 * n) for n in (2, 8, 16))
            ),
        }
    )
    for name, predictor in (("amdahl", amdahl), ("default", default)):
        moves = run(predictor)
        print(f"{name}: {len(moves)} move(s)")
        for line in moves:
            print(f"  {line}")
    print(f"amdahl learned rates: { {k: round(v, 2) for k, v in amdahl.rate.items()} }")


if __name__ == "__main__":
    main()
