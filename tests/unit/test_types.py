"""Base vocabulary: allocations, parallel sizes, the torchrun environment."""

from __future__ import annotations

import pytest

from dynarl import Allocation, DynarlError, ParallelDims, PeerLostError, ProtocolError
from dynarl._distenv import DistEnv


def test_allocation_is_canonical() -> None:
    a = Allocation.of({"trainer": [3, 2], "rollout": [1, 0]})
    b = Allocation.of({"rollout": [0, 1], "trainer": [2, 3]})
    assert a == b and hash(a) == hash(b)
    assert a.components == ("rollout", "trainer")
    assert a.counts() == {"rollout": 2, "trainer": 2}
    assert a.total == 4


def test_allocation_refuses_a_shared_device() -> None:
    with pytest.raises(ValueError, match="device 1 is held by both"):
        Allocation.of({"rollout": [0, 1], "trainer": [1, 2]})


def test_allocation_move() -> None:
    a = Allocation.of({"rollout": [0, 1, 2], "trainer": [3]})
    b = a.move([1, 2], "rollout", "trainer")
    assert b.as_dict() == {"rollout": [0], "trainer": [1, 2, 3]}
    assert b.total == a.total
    with pytest.raises(ValueError, match=r"does not hold devices \[3\]"):
        a.move([3], "rollout", "trainer")


def test_parallel_dims() -> None:
    dims = ParallelDims(tp=2, pp=2, dp=3)
    assert dims.model_parallel == 4 and dims.world_size == 12
    with pytest.raises(ValueError, match="tp must be a positive int"):
        ParallelDims(tp=0)


def test_dist_env_reads_torchrun_variables() -> None:
    env = DistEnv.from_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.rank, env.world_size, env.node_rank, env.master_port) == (3, 4, 1, 1234)
    assert DistEnv.from_env({}) == DistEnv()


def test_dist_env_names_a_bad_variable() -> None:
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        DistEnv.from_env({"RANK": "x"})


def test_error_tree() -> None:
    assert issubclass(ProtocolError, DynarlError)
    err = PeerLostError("worker-3")
    assert err.peer == "worker-3" and "worker-3" in str(err)
