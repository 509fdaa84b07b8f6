"""A closed process group leaves nothing behind in torch.distributed's registry or in the
job's store (a job that reshards for days builds new groups at every layout epoch)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

from torch.distributed import HashStore
from torch.distributed import distributed_c10d as c10d

from dynarl.migrate._groups import FLIGHT_RECORDER_VARIABLE, build_group


def test_closing_a_group_forgets_its_name_tag_and_rendezvous_key() -> None:
    world = c10d._world
    before = (set(world.tags_to_pg) - {""}, len(world.pg_map), len(world.pg_names))
    store = HashStore()
    for epoch in range(3):
        group = build_group(
            store, name=f"dynarl/{epoch}/tp/0", ranks=(0,), rank=0, timeout=timedelta(seconds=5)
        )
        assert f"ptd:{group.name}" in world.tags_to_pg
        assert group.store is not None and group.store.check([group.rendezvous_key])
        group.close()
        group.close()  # idempotent
        assert not group.store.check([group.rendezvous_key])
    assert world.tags_to_pg.get("", []) == []
    assert (set(world.tags_to_pg) - {""}, len(world.pg_map), len(world.pg_names)) == before


# The process ends with os._exit: after 40 groups were destroyed, torch 2.13 often aborts
# at interpreter exit ("terminate called without an active exception", 5 of 6 runs here,
# none with 0 or 1 group) — a teardown of its own threads after what is measured here.
_GROUPS_IN_A_FRESH_PROCESS = """
import os, pickle, sys
from datetime import timedelta
import torch
from torch.distributed import HashStore
from torch._C._distributed_c10d import _dump_fr_trace
from dynarl.migrate._groups import build_group
store = HashStore()
for epoch in range(int(sys.argv[1])):
    group = build_group(store, name=f"dynarl/{epoch}/dp/0", ranks=(0,), rank=0)
    group.pg.allreduce([torch.ones(4)]).wait()
    group.close()
trace = pickle.loads(_dump_fr_trace(includeCollectives=True, onlyActive=False))
print(len(trace.get("pg_status", {})), len(trace.get("entries", [])), flush=True)
os._exit(0)
"""


def _flight_recorder_after(num_groups: int, **env: str) -> tuple[int, int]:
    """(process groups, collectives) torch's flight recorder holds in a fresh process that
    built, used and closed ``num_groups`` groups (the recorder is one per process)."""
    environ = {k: v for k, v in os.environ.items() if k != FLIGHT_RECORDER_VARIABLE} | env
    command = [sys.executable, "-c", _GROUPS_IN_A_FRESH_PROCESS, str(num_groups)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=environ, check=True
    )
    groups, collectives = result.stdout.split()
    return int(groups), int(collectives)


def test_closed_groups_leave_nothing_in_the_flight_recorder() -> None:
    # torch keeps one status per group it ever saw: a job resharding for days would grow.
    assert _flight_recorder_after(40) == (0, 0)


def test_a_flight_recorder_the_user_sized_records() -> None:
    groups, collectives = _flight_recorder_after(40, **{FLIGHT_RECORDER_VARIABLE: "8"})
    assert collectives == 8 and groups > 0
