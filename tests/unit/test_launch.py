"""The launcher in one process: two ranks rendezvous over a real TCPStore and talk over a
CURVE bus on loopback; a restarted controller resumes from journal and checkpoint; a node
whose key is not on the allow-list is refused, at the rendezvous and by ZeroMQ."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import standin_job
from torch._C._distributed_c10d import TCPStore

from dynarl._distenv import DistEnv
from dynarl.bus import (
    BusClient,
    BusConfig,
    BusServer,
    CurveClient,
    generate_keys,
    load_secret_key,
    run,
)
from dynarl.bus._messages import Ping, Pong
from dynarl.errors import DeadlineExceeded, WorkerError
from dynarl.runtime.durable._journal import recover
from dynarl.runtime.launch._torchrun import (
    ControllerContext,
    LaunchConfig,
    WorkerContext,
    load_job,
    open_store,
    parse_args,
    run_node,
)

FAST = BusConfig(heartbeat_interval_s=0.5, register_timeout_s=1.0)


@pytest.fixture
def master() -> Iterator[TCPStore]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=30))  # fmt: skip
    yield store


def env(rank: int, port: int) -> DistEnv:
    return DistEnv(
        rank=rank, world_size=2, node_rank=rank, master_addr="127.0.0.1", master_port=port,
        use_agent_store=True,  # the test's master store plays torchrun's agent store
    )  # fmt: skip


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """Secret key files of node0, node1 and mallory; ``authorized`` holds node0's and
    node1's public keys only."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    out = {"authorized": authorized}
    for name in ("node0", "node1", "mallory"):
        public, secret = generate_keys(tmp_path / "keys", name)
        if name != "mallory":
            shutil.copy(public, authorized / public.name)
        out[name] = secret
    return out


def configs(tmp_path: Path, keys: dict[str, Path], *args: str) -> list[LaunchConfig]:
    base = LaunchConfig(
        job="standin_job:JOB", job_dir=tmp_path / "job", curve=True, key_file=keys["node0"],
        allowed_keys=(keys["authorized"],), rendezvous_timeout_s=30.0, args=args,
    )  # fmt: skip
    return [base, replace(base, key_file=keys["node1"])]


def launch(configs: list[LaunchConfig], port: int) -> None:
    job = load_job("standin_job:JOB")

    async def main() -> None:
        stores = [open_store(env(rank, port), 30.0) for rank in (0, 1)]
        async with asyncio.TaskGroup() as group:
            for rank, config in enumerate(configs):
                group.create_task(run_node(job, config, env(rank, port), stores[rank]))

    run(main())


def test_two_ranks_run_over_curve_and_a_restarted_controller_resumes(
    tmp_path: Path, keys: dict[str, Path], master: TCPStore
) -> None:
    (tmp_path / "job").mkdir()
    first = configs(tmp_path, keys, "--steps", "3", "--checkpoint-every", "2")
    launch(first, master.port)
    result = json.loads((tmp_path / "job" / "result.json").read_text())
    options = standin_job.parse(["--steps", "3"])
    assert result["digests"] == standin_job.reference(options)["digests"]
    assert result["checksum"] == standin_job.reference(options)["checksum"]
    assert result["violations"] == [] and result["workers"] == ["rank-0", "rank-1"]
    assert result["resumed_from"] == -1
    # A new controller (same store, same job dir) for three more steps: it restores the
    # checkpoint taken after step 2, redoes step 2 (same digest) and carries on.
    launch(configs(tmp_path, keys, "--steps", "6", "--checkpoint-every", "2"), master.port)
    result = json.loads((tmp_path / "job" / "result.json").read_text())
    expected = standin_job.reference(standin_job.parse(["--steps", "6"]))
    assert result["resumed_from"] == 2 and result["violations"] == []
    assert result["digests"][-4:] == expected["digests"][2:]
    assert result["checksum"] == expected["checksum"]
    state = recover(tmp_path / "job" / "journal")
    assert state.epoch == 1 and state.steps_done == 6
    assert state.checkpoint is not None and state.checkpoint.steps_done == 6


class ProbeJob:
    """Binds the bus, admits workers, and stops when told; records what it saw."""

    def __init__(self) -> None:
        self.address: asyncio.Future[str] | None = None
        self.release = asyncio.Event()
        self.peers: list[str] = []

    async def controller(self, context: ControllerContext) -> None:
        assert self.address is not None
        async with BusServer(context.bind_address, curve=context.curve, config=FAST) as bus:
            context.announce(bus.address)
            self.address.set_result(bus.address)
            await self.release.wait()
            self.peers = bus.peers()

    async def worker(self, context: WorkerContext) -> None:
        client = BusClient(context.address, name=context.name, config=FAST, curve=context.curve)
        async with client:
            assert await client.request(Ping(seq=7)) == Pong(seq=7)
            await self.release.wait()


def test_a_node_whose_key_is_not_allowed_is_refused(
    tmp_path: Path, keys: dict[str, Path], master: TCPStore
) -> None:
    honest, _ = configs(tmp_path, keys)
    intruder = replace(honest, key_file=keys["mallory"])
    probe = ProbeJob()

    async def main() -> None:
        probe.address = asyncio.get_running_loop().create_future()
        async with asyncio.TaskGroup() as group:
            node0 = group.create_task(
                run_node(probe, honest, env(0, master.port), open_store(env(0, master.port), 30))
            )
            address = await probe.address
            with pytest.raises(WorkerError, match="not on the controller's allow-list"):
                await run_node(
                    probe, intruder, env(1, master.port), open_store(env(1, master.port), 30)
                )
            # Ignoring the refusal does not help: ZeroMQ refuses the handshake.
            curve = CurveClient(key_file=keys["mallory"], server_key=_server_key(keys))
            with pytest.raises(DeadlineExceeded):
                await BusClient(address, name="mallory", config=FAST, curve=curve).start()
            probe.release.set()
        assert node0.done()

    run(main())
    assert probe.peers == ["rank-0"]


def _server_key(keys: dict[str, Path]) -> bytes:
    return load_secret_key(keys["node0"])[0]


def test_the_command_line(tmp_path: Path, keys: dict[str, Path]) -> None:
    config = parse_args(
        ["--job", "standin_job:JOB", "--job-dir", str(tmp_path), "--bind-host", "0.0.0.0",
         "--key-file", str(keys["node0"]), "--allowed-keys", str(keys["authorized"]),
         "--", "--steps", "9"]
    )  # fmt: skip
    assert config.secured and config.args == ("--steps", "9") and config.bind_host == "0.0.0.0"
    with pytest.raises(ValueError, match="needs --key-file and --allowed-keys"):
        parse_args(["--job", "m:a", "--job-dir", str(tmp_path), "--bind-host", "10.0.0.1"])
    with pytest.raises(ValueError, match="module:attribute"):
        LaunchConfig(job="nothing", job_dir=tmp_path)
    with pytest.raises(ValueError, match="not a JobSpec nor a function returning one"):
        load_job("standin_job:MAX_TOKENS")
