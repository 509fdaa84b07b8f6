"""The TCPStores dynarl hosts listen on the address their clients are given, not on every
interface (torch's own does): loopback for the local controller's, MASTER_ADDR for rank 0's
under torchrun when torchrun's agent does not host it."""

from __future__ import annotations

import gc
import os

import psutil
import pytest
from torch._C._distributed_c10d import TCPStore

from dynarl._distenv import DistEnv
from dynarl.runtime._store import host_store
from dynarl.runtime.launch._torchrun import open_store


def listening_on(port: int) -> set[str]:
    """Addresses this process listens on at ``port``."""
    return {
        c.laddr.ip
        for c in psutil.Process(os.getpid()).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_a_hosted_store_listens_on_its_host_only_and_serves() -> None:
    store = host_store("127.0.0.1", 0, timeout_s=10)
    port = store.port
    assert listening_on(port) == {"127.0.0.1"}
    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    client.set("key", "value")
    assert store.get("key") == b"value"
    del client, store
    gc.collect()
    assert listening_on(port) == set()  # the store owned its socket, and closed it


def test_torch_alone_would_listen_everywhere() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    assert listening_on(port) <= {"0.0.0.0", "::"} and listening_on(port)
    del store
    gc.collect()


def test_rank_0_hosts_the_job_store_on_master_addr_unless_the_agent_does() -> None:
    probe = host_store("127.0.0.1", 0, timeout_s=10)
    port = probe.port
    del probe
    gc.collect()
    rank0 = DistEnv(rank=0, world_size=2, master_addr="localhost", master_port=port)
    store = open_store(rank0, timeout_s=10)
    assert listening_on(port) and listening_on(port) <= {"127.0.0.1", "::1"}
    worker = open_store(
        DistEnv(rank=1, world_size=2, master_addr="localhost", master_port=port), 10
    )
    worker.set("admitted", "1")
    assert store.get("admitted") == b"1"
    del worker, store
    gc.collect()


def test_a_host_that_is_not_this_machines_is_refused() -> None:
    with pytest.raises(OSError):
        host_store("192.0.2.1", 0, timeout_s=1)  # TEST-NET-1: no interface here has it
