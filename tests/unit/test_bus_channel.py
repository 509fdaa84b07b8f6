"""Channels: keyed FIFO queues with backpressure, in process and over the bus."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from dynarl import Channel
from dynarl.bus import BusClient, BusConfig, BusServer, GenerationRequest, Sample, pack_tokens, run
from dynarl.bus._channel import ChannelTable
from dynarl.bus._messages import ChannelItem
from dynarl.errors import BusError, DeadlineExceeded, ProtocolError

CONFIG = BusConfig(heartbeat_interval_s=0.1, default_timeout_s=10.0)
_names = itertools.count()


def sample(n: int) -> Sample:
    return Sample(sample_id=f"s{n}", token_ids=pack_tokens([n, n + 1]), prompt_len=1)


def drive(main: Any) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(30):
            return await main

    return run(bounded())


async def backpressure_and_order(samples: Channel[Sample]) -> None:
    await samples.put(sample(0), key="a")
    await samples.put(sample(1), key="a")
    await samples.put(sample(9), key="b")  # another key has its own room
    blocked = asyncio.create_task(samples.put(sample(2), key="a"))
    await asyncio.sleep(0.05)
    assert not blocked.done(), "put into a full queue returned"
    assert (await samples.get(key="a")).sample_id == "s0"
    await blocked
    got = [(await samples.get(key="a")).sample_id for _ in range(2)]
    assert got == ["s1", "s2"]
    assert (await samples.get(key="b")).sample_id == "s9"


def test_local_channel_backpressure_and_order() -> None:
    drive(backpressure_and_order(Channel("samples", Sample, capacity=2).bind(ChannelTable())))


@pytest.mark.parametrize("transport", ["mem", "tcp"])
def test_bus_channel_backpressure_and_order(transport: str) -> None:
    async def main() -> None:
        where = f"mem://chan-{next(_names)}" if transport == "mem" else "tcp://127.0.0.1:0"
        async with BusServer(where, config=CONFIG) as server:
            async with BusClient(server.address, name="p", config=CONFIG) as client:
                await backpressure_and_order(Channel("samples", Sample, capacity=2).bind(client))
                assert server.channels.sizes() == {("samples", "a"): 0, ("samples", "b"): 0}

    drive(main())


@pytest.mark.parametrize("transport", ["mem", "tcp"])
def test_deadlines_neither_lose_nor_duplicate_items(transport: str) -> None:
    async def main() -> None:
        where = f"mem://chan-{next(_names)}" if transport == "mem" else "tcp://127.0.0.1:0"
        async with BusServer(where, config=CONFIG) as server:
            async with BusClient(server.address, name="p", config=CONFIG) as client:
                channel = Channel("c", Sample, capacity=1).bind(client)
                with pytest.raises(DeadlineExceeded):
                    await channel.get(timeout=0.05)  # empty: the remote get is cancelled
                await channel.put(sample(1))
                with pytest.raises(DeadlineExceeded):
                    await channel.put(sample(2), timeout=0.05)  # full: not added
                await asyncio.sleep(0.05)
                assert (await channel.get()).sample_id == "s1"
                assert server.channels.sizes() == {("c", ""): 0}

    drive(main())


def test_an_item_answering_an_abandoned_get_is_put_back() -> None:
    async def main() -> None:
        async with BusServer(f"mem://chan-{next(_names)}", config=CONFIG) as server:
            async with BusClient(server.address, name="p", config=CONFIG) as client:
                # The race this covers: the server sent the item just as the get's deadline
                # passed, so the reply matches no waiting request.
                orphan = ChannelItem(channel="c", key="k", item=sample(5))
                client._stale_reply(client._server, orphan)
                channel = Channel("c", Sample).bind(client)
                assert (await channel.get(key="k")).sample_id == "s5"

    drive(main())


def test_channel_declaration_checks() -> None:
    with pytest.raises(TypeError, match="Sample or GenerationRequest"):
        Channel("x", int)  # type: ignore[type-var]
    with pytest.raises(ValueError, match="capacity"):
        Channel("x", Sample, capacity=0)
    with pytest.raises(ValueError, match="name"):
        Channel("", Sample)
    unbound = Channel("x", Sample)
    assert "unbound" in repr(unbound)
    with pytest.raises(BusError, match="not bound"):
        drive(unbound.get())


def test_channel_items_are_typed() -> None:
    async def main() -> None:
        table = ChannelTable()
        samples = Channel("mixed", Sample).bind(table)
        requests = Channel("mixed", GenerationRequest).bind(table)
        with pytest.raises(TypeError, match="carries Sample"):
            await samples.put(GenerationRequest(sample_id="g", token_ids=b"", max_new_tokens=1))  # type: ignore[arg-type]
        await requests.put(GenerationRequest(sample_id="g", token_ids=b"", max_new_tokens=1))
        with pytest.raises(ProtocolError, match="expected Sample"):
            await samples.get()

    drive(main())
