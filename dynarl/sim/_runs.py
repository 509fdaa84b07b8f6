"""Running policies on a workload: one run, a comparison on the same trace, a sweep.

Every run builds a fresh :class:`~dynarl.sim.Simulation` (so runs share
nothing but the trace, which is a pure function of the workload's seed). The engines'
request order is the policy's (``dynarl+priority``: DynaRL's priority; every other
policy: FIFO, SGLang's default).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

from dynarl.sched import FifoPolicy
from dynarl.sim._results import RunResult
from dynarl.sim._simulator import Simulation
from dynarl.sim._vector import VectorRollout
from dynarl.sim._workload_file import Workload, with_overrides
from dynarl.sim.policies import POLICY_NAMES, DynarlPolicy, make_policy

__all__ = ["compare", "run_policy", "sweep"]

logger = logging.getLogger(__name__)


def run_policy(workload: Workload, policy: str, *, vector: bool = False) -> RunResult:
    """Simulate ``policy`` on ``workload``; raises ValueError for an unknown policy.

    ``vector`` runs rollout on the vectorised per-engine model (math workloads, FIFO).
    """
    chosen = make_policy(policy)
    request = chosen.request_policy if isinstance(chosen, DynarlPolicy) else FifoPolicy
    factory = VectorRollout if vector else None
    sim = Simulation(workload, request_policy=request, rollout_factory=factory)
    result = sim.run(chosen)
    if isinstance(chosen, DynarlPolicy) and chosen.scheduler is not None:
        decisions = len(chosen.scheduler.ledger.query(kind="decision"))
        result = _with_decisions(result, decisions)
    logger.info("%s on %s: %.1f %s", policy, workload.name, result.throughput, result.unit)
    return result


def _with_decisions(result: RunResult, decisions: int) -> RunResult:
    return replace(result, num_decisions=decisions)


def compare(
    workload: Workload, policies: Sequence[str] = POLICY_NAMES, *, vector: bool = False
) -> list[RunResult]:
    """Every policy in ``policies`` on the same trace, in order."""
    return [run_policy(workload, name, vector=vector) for name in policies]


def sweep(
    workload: Workload,
    key: str,
    values: Sequence[object],
    policy: str = "dynarl",
    *,
    vector: bool = False,
) -> dict[object, RunResult]:
    """``policy`` with ``key`` set to each of ``values`` (see :func:`with_overrides`)."""
    out = {}
    for value in values:
        changed: Mapping[str, object] = {key: value}
        out[value] = run_policy(with_overrides(workload, changed), policy, vector=vector)
    return out
