"""The one-minute chaos run (``make chaos`` runs the long one): the durable reference job
(its engine and Megatron trainer) across three hosts under seeded worker kills, link cuts
and controller kills, fired at event counts (markers ``dist`` and ``netns``;
``tests/chaos.py``).

Over the whole run every sample is trained exactly once, the journalled step digests and
the trainer's checksum equal an uninterrupted run's, nothing is left running, and the run
met at least one fault of each kind the seed plans for its first steps.
"""

from __future__ import annotations

import logging
from pathlib import Path

import chaos
import chaos_loop
import pytest
from netns_support import unavailable

from dynarl.runtime._faults import FaultAction

pytestmark = [pytest.mark.dist, pytest.mark.netns]

logger = logging.getLogger(__name__)

SECONDS = 60.0
"""Shorter than the issue's two minutes: make test must stay under 15 minutes on two cores
(``CHAOS_S=120 make chaos`` is the two-minute run; a minute meets ~8 faults of all kinds)."""
SEED = 3


def test_the_fault_plan_is_a_pure_function_of_seed_and_attempt() -> None:
    plan = [chaos_loop.fault_of(SEED, attempt) for attempt in range(40)]
    assert plan == [chaos_loop.fault_of(SEED, attempt) for attempt in range(40)]
    assert plan != [chaos_loop.fault_of(SEED + 1, attempt) for attempt in range(40)]
    assert plan[0] is None  # the first step makes the first checkpoint
    actions = {f.action for f in plan if f is not None}
    assert actions == {FaultAction.KILL, FaultAction.CUT, FaultAction.KILL_CONTROLLER}
    for fault in plan:
        if fault is not None and fault.action is not FaultAction.KILL_CONTROLLER:
            assert fault.device in (1, 2) and fault.phase in chaos_loop.PHASES


def test_a_short_chaos_run_trains_every_sample_exactly_once(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    summary = chaos.run_chaos(SECONDS, SEED, tmp_path, chaos.stack_of("reference"))
    logger.warning("CHAOS\n%s", chaos.report(summary))
    assert summary["faults"] >= 3, summary
    assert summary["samples_lost"] == 0 and summary["samples_duplicated"] == 0, summary
    assert summary["violations"] == 0, summary
    assert summary["digests_equal"] and summary["checksum_equal"], summary
    assert summary["left_running"] == 0, summary
    assert chaos.ok(summary)
