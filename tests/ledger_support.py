"""Ledger records for the ledger and summary tests: a hold, a commit and its migration."""

from __future__ import annotations

from dynarl.bus import Commit, DecisionRecord, MigrationRecord, NoDonor

ALLOC = {"rollout": 2, "trainer": 1}
MOVED = {"rollout": 1, "trainer": 2}


def hold(i: int, time: float) -> DecisionRecord:
    return DecisionRecord(
        decision_id=f"d{i}",
        time=time,
        committed=False,
        reason=NoDonor(),
        old_allocation=ALLOC,
        new_allocation=ALLOC,
    )


def commit(i: int, time: float) -> DecisionRecord:
    return DecisionRecord(
        decision_id=f"d{i}",
        time=time,
        committed=True,
        reason=Commit(gain_s=1.0, cost_s=0.2, bottleneck="trainer"),
        old_allocation=ALLOC,
        new_allocation=MOVED,
        expected_gain_s=1.0,
        migration_cost_s=0.2,
    )


def migration(decision_id: str, time: float) -> MigrationRecord:
    return MigrationRecord(
        migration_id="m1",
        decision_id=decision_id,
        time=time,
        kind="p2p",
        component="trainer",
        src_devices=(2,),
        dst_devices=(1, 2),
        outcome="committed",
    )
