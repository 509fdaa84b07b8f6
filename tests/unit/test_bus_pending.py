"""Outstanding requests share one deadline timer; answered ones do not pile up."""

from __future__ import annotations

import asyncio

import pytest

from dynarl.bus import run
from dynarl.bus._peers import Peer
from dynarl.bus._pending import PendingRequests
from dynarl.errors import BusError, DeadlineExceeded


def test_deadlines_fire_in_order_and_answered_requests_are_forgotten() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        expired: list[int] = []
        pending = PendingRequests(loop, lambda peer, rid: expired.append(rid))
        peer = Peer(name="p", key=b"", last_seen=0.0)
        futures = {}
        for rid in range(1, 3001):  # answered at once, like most requests
            futures[rid] = loop.create_future()
            pending.add(rid, futures[rid], peer, 60.0)
            del pending.waiting[rid]
        assert len(pending._deadlines) <= 2 * len(pending.waiting) + 1025
        for rid, seconds in ((9001, 0.03), (9000, 0.01), (9002, 60.0)):
            futures[rid] = loop.create_future()
            pending.add(rid, futures[rid], peer, seconds)
        with pytest.raises(DeadlineExceeded, match=r"within 0\.01 s"):
            await futures[9000]
        with pytest.raises(DeadlineExceeded, match=r"within 0\.03 s"):
            await futures[9001]
        assert expired == [9000, 9001]
        assert not futures[9002].done()
        pending.close(BusError("closed"))
        with pytest.raises(BusError, match="closed"):
            await futures[9002]
        assert pending.waiting == {}

    run(main())


def test_failing_a_peer_fails_only_its_requests() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        pending = PendingRequests(loop, lambda peer, rid: None)
        alice, bob = (Peer(name=n, key=n.encode(), last_seen=0.0) for n in ("alice", "bob"))
        mine, theirs = loop.create_future(), loop.create_future()
        pending.add(1, mine, alice, 60.0)
        pending.add(2, theirs, bob, 60.0)
        pending.fail(alice, BusError("alice lost"))
        assert isinstance(mine.exception(), BusError) and not theirs.done()
        assert list(pending.waiting) == [2]
        pending.close(BusError("closed"))
        assert isinstance(theirs.exception(), BusError)

    run(main())
