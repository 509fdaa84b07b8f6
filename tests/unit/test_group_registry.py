"""A closed process group leaves nothing behind in torch.distributed's registry or in the
job's store (a job that reshards for days builds new groups at every layout epoch)."""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import HashStore
from torch.distributed import distributed_c10d as c10d

from dynarl.migrate._groups import build_group


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
