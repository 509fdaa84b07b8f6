"""A bus peer in its own process, for tests that kill it (``python bus_peer_process.py``).

``server``: serve on loopback, print the address. ``client ADDRESS``: register as
"victim". Either way, ``Interrupt`` requests print "handling" and then wait forever.
"""

from __future__ import annotations

import asyncio
import sys

from dynarl.bus import BusClient, BusConfig, BusServer, Interrupt, Peer, run
from dynarl.bus._messages import Ack

CONFIG = BusConfig(heartbeat_interval_s=0.1, num_missed_heartbeats=2, default_timeout_s=60.0)


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def hang(message: Interrupt, peer: Peer) -> Ack:
    say("handling")
    await asyncio.Event().wait()
    return Ack()


async def main(role: str, address: str) -> None:
    if role == "server":
        async with BusServer(config=CONFIG) as server:
            server.route(Interrupt, hang)
            say(server.address)
            await asyncio.Event().wait()
    async with BusClient(address, name="victim", config=CONFIG) as client:
        client.route(Interrupt, hang)
        say("ready")
        await asyncio.Event().wait()


if __name__ == "__main__":
    run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""))
