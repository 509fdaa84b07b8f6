"""Killing a peer's process fails the requests waiting on it with PeerLostError, long
before their 60 s deadline: within (num_missed_heartbeats + 1) heartbeat intervals by the
rule in ``dynarl.bus._peers``, which ``test_the_loss_rule`` checks exactly."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from dynarl.bus import BusClient, BusConfig, BusServer, Interrupt, run
from dynarl.bus._peers import Peer, overdue
from dynarl.errors import PeerLostError

sys.path.insert(0, str(Path(__file__).parent))
from bus_peer_process import CONFIG

SCRIPT = str(Path(__file__).parent / "bus_peer_process.py")


async def spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, SCRIPT, *args, stdout=asyncio.subprocess.PIPE
    )


async def line(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    return (await process.stdout.readline()).decode().strip()


async def kill(process: asyncio.subprocess.Process) -> None:
    process.kill()
    await process.wait()


def test_killing_a_client_fails_the_servers_waiter() -> None:
    async def main() -> None:
        async with asyncio.timeout(30):
            async with BusServer(config=CONFIG) as server:
                victim = await spawn("client", server.address)
                try:
                    assert await line(victim) == "ready"
                    waiting = asyncio.create_task(
                        server.request("victim", Interrupt(component="x"), timeout=60)
                    )
                    assert await line(victim) == "handling"
                    await kill(victim)
                    with pytest.raises(PeerLostError, match="victim"):
                        await waiting
                    assert server.stats.peers_lost == 1 and server.peers() == []
                finally:
                    if victim.returncode is None:
                        await kill(victim)

    run(main())


def test_killing_the_server_fails_the_clients_waiter() -> None:
    async def main() -> None:
        async with asyncio.timeout(30):
            victim = await spawn("server")
            try:
                address = await line(victim)
                async with BusClient(address, name="survivor", config=CONFIG) as client:
                    waiting = asyncio.create_task(
                        client.request(Interrupt(component="x"), timeout=60)
                    )
                    assert await line(victim) == "handling"
                    await kill(victim)
                    with pytest.raises(PeerLostError):
                        await waiting
                    assert client.lost
            finally:
                if victim.returncode is None:
                    await kill(victim)

    run(main())


def test_the_loss_rule() -> None:
    """Lost exactly when silent for more than num_missed_heartbeats × interval."""
    config = BusConfig(heartbeat_interval_s=0.5, num_missed_heartbeats=2)
    loss_after = config.loss_after_s
    peers = [Peer(name=f"p{n}", key=b"", last_seen=float(n)) for n in range(5)]
    assert overdue(peers, 4.0 + loss_after, loss_after) == peers[:4]
    assert overdue(peers, 4.0 + loss_after + 1e-6, loss_after) == peers
    # Checked four times per interval, and a live peer speaks once per interval, so the
    # latest a dead peer is declared lost after its death is below (misses + 1) intervals.
    for each in (config, CONFIG):
        worst = each.loss_after_s + each.check_interval_s
        assert worst < (each.num_missed_heartbeats + 1) * each.heartbeat_interval_s
