"""Running policies on a workload: one run, a comparison on the same trace, a sweep.

Every run builds a fresh :class:`~dynarl.sim.simulator.Simulation` (so runs share
nothing but the trace, which is a pure function of the workload's seed). The engines'
request order is the policy's (``dynarl+priority``: DynaRL's priority; every other
policy: FIFO, SGLang's default).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from dynarl.sched import FifoPolicy
from dynarl.sim.policies import POLICY_NAMES, DynarlPolicy, make_policy
from dynarl.sim.report import RunResult
from dynarl.sim.simulator import Simulation
from dynarl.sim.workload import Workload, with_overrides

__all__ = ["compare", "run_policy", "sweep"]

logger = logging.getLogger(__name__)


def run_policy(workload: Workload, policy: str) -> RunResult:
    """Simulate ``policy`` on ``workload``; raises ValueError for an unknown policy."""
    chosen = make_policy(policy)
    request = chosen.request_policy if isinstance(chosen, DynarlPolicy) else FifoPolicy
    sim = Simulation(workload, request_policy=request)
    result = sim.run(chosen)
    if isinstance(chosen, DynarlPolicy) and chosen.scheduler is not None:
        decisions = len(chosen.scheduler.ledger.query(kind="decision"))
        result = _with_decisions(result, decisions)
    logger.info("%s on %s: %.1f %s", policy, workload.name, result.throughput, result.unit)
    return result


def _with_decisions(result: RunResult, decisions: int) -> RunResult:
    from dataclasses import replace

    return replace(result, num_decisions=decisions)


def compare(workload: Workload, policies: Sequence[str] = POLICY_NAMES) -> list[RunResult]:
    """Every policy in ``policies`` on the same trace, in order."""
    return [run_policy(workload, name) for name in policies]


def sweep(
    workload: Workload, key: str, values: Sequence[object], policy: str = "dynarl"
) -> dict[object, RunResult]:
    """``policy`` with ``key`` set to each of ``values`` (see :func:`with_overrides`)."""
    out = {}
    for value in values:
        changed: Mapping[str, object] = {key: value}
        out[value] = run_policy(with_overrides(workload, changed), policy)
    return out
