"""Differential: the in-process and ZeroMQ transports deliver the same multiset of messages.

One generated scenario — requests and notifications from the client, requests from the
server, events published — runs over ``mem://`` and over ``tcp://``; what each side
received is compared as a multiset of encoded messages, with each other and with what
was sent.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from dynarl.bus import BusClient, BusConfig, BusServer, PeerEvent, Publisher, run
from dynarl.bus._messages import Ack, EventMessage, Heartbeat, Message, Register, Unregister
from dynarl.bus._pubsub import Subscriber
from dynarl.errors import DeadlineExceeded
from dynarl.testing import message_strategy

CONFIG = BusConfig(heartbeat_interval_s=0.5, default_timeout_s=10.0)
BUILT_IN = {Register, Unregister, Heartbeat}  # their handlers are the protocol itself
ROUTABLE = [t for t in Message.__args__ if t not in BUILT_IN]
_addresses = itertools.count()
encode = msgspec.msgpack.encode


@dataclass(frozen=True)
class Scenario:
    requests: list[Any]
    notifications: list[Any]
    server_requests: list[Any]
    events: list[Any]


messages = st.one_of(*(message_strategy(t) for t in ROUTABLE))
scenarios = st.builds(
    Scenario,
    requests=st.lists(messages, max_size=8),
    notifications=st.lists(messages, max_size=8),
    server_requests=st.lists(messages, max_size=8),
    events=st.lists(message_strategy(EventMessage), max_size=8),
)


async def deliver(transport: str, scenario: Scenario) -> dict[str, Counter[bytes]]:
    where = f"mem://diff-{next(_addresses)}" if transport == "mem" else "tcp://127.0.0.1:0"
    got: dict[str, Counter[bytes]] = {key: Counter() for key in ("server", "client", "events")}

    def record(side: str) -> Any:
        def handler(message: Any, peer: Any) -> Ack:
            got[side][encode(message)] += 1
            return Ack()

        return handler

    pub_where = where.replace("diff", "diff-pub") if transport == "mem" else where
    async with (
        BusServer(where, config=CONFIG) as server,
        BusClient(server.address, name="c", config=CONFIG) as client,
        Publisher(pub_where) as publisher,
        Subscriber(publisher.address) as subscriber,
    ):
        for kind in ROUTABLE:
            server.route(kind, record("server"))
            client.route(kind, record("client"))
        await settle(publisher, subscriber)
        for message in scenario.notifications:
            assert client.notify(message)
        replies = await asyncio.gather(
            *(client.request(message) for message in scenario.requests),
            *(server.request("c", message) for message in scenario.server_requests),
        )
        assert all(reply == Ack() for reply in replies)
        for event in scenario.events:
            publisher.publish("events", event)
        while sum(got["events"].values()) < len(scenario.events):
            _, event = await subscriber.recv(timeout=5)
            got["events"][encode(event)] += 1
        # notifications are one-way: a final request on the same link has overtaken none
        await client.request(Ack(detail="fence"))
        got["server"][encode(Ack(detail="fence"))] -= 1
    return got


async def settle(publisher: Publisher, subscriber: Subscriber) -> None:
    """Wait until the subscription has reached the publisher (PUB/SUB joins late)."""
    probe = PeerEvent(peer="probe", event="registered", time=0.0)
    async with asyncio.timeout(10):
        while True:
            publisher.publish("probe", probe)
            try:
                await subscriber.recv(timeout=0.02)
                break
            except DeadlineExceeded:
                continue
    while True:  # drain late probes
        try:
            await subscriber.recv(timeout=0.02)
        except DeadlineExceeded:
            return


@settings(max_examples=max(10, settings().max_examples // 2))
@given(scenarios)
def test_in_process_and_zeromq_deliver_the_same_multiset(scenario: Scenario) -> None:
    mem = run(deliver("mem", scenario))
    tcp = run(deliver("tcp", scenario))
    sent = {
        "server": Counter(encode(m) for m in scenario.requests + scenario.notifications),
        "client": Counter(encode(m) for m in scenario.server_requests),
        "events": Counter(encode(m) for m in scenario.events),
    }
    for side in sent:
        assert +mem[side] == +tcp[side] == sent[side], side
