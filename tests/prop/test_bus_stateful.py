"""Model-based test of request/reply with deadlines and cancellation, on both transports.

The model is a dict of outstanding requests, each "long" (60 s deadline, finished only by
a release or a cancel) or "short" (a deadline that will pass). The real bus runs on an
event loop the machine owns; every step drives the loop until its effect is complete.
Checked: a released request gets exactly its own reply; a cancelled one raises
CancelledError and its server handler is cancelled; an expired one raises
DeadlineExceeded and its handler is cancelled; the server runs a handler for every
outstanding long request and for nothing the model does not know.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from dynarl.bus import BusClient, BusConfig, BusServer, Interrupt, Peer
from dynarl.bus._loop import new_event_loop
from dynarl.bus._messages import Ack
from dynarl.errors import DeadlineExceeded

SHORT_S = 0.05
CONFIG = BusConfig(heartbeat_interval_s=0.5, default_timeout_s=60.0)
_addresses = itertools.count()


class RequestReply(RuleBasedStateMachine):
    """Conformance machine: subclasses pick the transport."""

    transport = "mem"
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.loop = new_event_loop()
        self.ids = itertools.count()
        self.model: dict[int, str] = {}
        self.tasks: dict[int, asyncio.Task[Any]] = {}
        self.gates: dict[int, asyncio.Event] = {}
        self.active: set[int] = set()
        self.started: set[int] = set()
        self.cancelled: set[int] = set()
        where = (
            f"mem://machine-{next(_addresses)}" if self.transport == "mem" else "tcp://127.0.0.1:0"
        )
        self.server = BusServer(where, config=CONFIG)
        self.client: BusClient | None = None
        self.loop.run_until_complete(self._open())

    async def _open(self) -> None:
        await self.server.start()
        self.server.route(Interrupt, self._handle)
        self.client = await BusClient(self.server.address, name="m", config=CONFIG).start()

    async def _handle(self, message: Interrupt, peer: Peer) -> Ack:
        key = int(message.component)
        self.started.add(key)
        self.active.add(key)
        try:
            await self.gates[key].wait()
        except asyncio.CancelledError:
            self.cancelled.add(key)
            raise
        finally:
            self.active.discard(key)
        return Ack(detail=message.component)

    def drive(self, done: Callable[[], bool], what: str) -> None:
        async def until() -> None:
            try:
                async with asyncio.timeout(10):
                    while not done():  # noqa: ASYNC110 - conditions on the machine's model
                        await asyncio.sleep(0.001)
            except TimeoutError:
                raise AssertionError(f"never happened: {what}") from None

        self.loop.run_until_complete(until())

    @rule(target=requests, short=st.booleans())
    def send(self, short: bool) -> int:
        key = next(self.ids)
        self.gates[key] = asyncio.Event()
        assert self.client is not None
        request = self.client.request(
            Interrupt(component=str(key)), timeout=SHORT_S if short else 60
        )
        self.tasks[key] = self.loop.create_task(request)
        self.model[key] = "short" if short else "long"
        if not short:
            self.drive(lambda: key in self.started, f"handler {key} started")
        return key

    @rule(key=consumes(requests))
    def release(self, key: int) -> None:
        task = self.tasks.pop(key)
        if self.model.pop(key) == "long":
            self.gates[key].set()
            self.drive(task.done, f"reply to {key}")
            assert task.result() == Ack(detail=str(key))
            assert key not in self.cancelled
        else:
            self.drive(task.done, f"deadline of {key}")
            assert isinstance(task.exception(), DeadlineExceeded)
            self.drive(lambda: key not in self.active, f"handler {key} gone after its deadline")

    @rule(key=consumes(requests))
    def cancel(self, key: int) -> None:
        task = self.tasks.pop(key)
        kind = self.model.pop(key)
        task.cancel()
        self.drive(task.done, f"cancellation of {key}")
        if kind == "long":
            assert task.cancelled()
            self.drive(lambda: key in self.cancelled, f"handler {key} cancelled")
        self.drive(lambda: key not in self.active, f"handler {key} gone")

    @invariant()
    def server_runs_what_the_model_has_outstanding(self) -> None:
        longs = {key for key, kind in self.model.items() if kind == "long"}
        shorts = {key for key, kind in self.model.items() if kind == "short"}
        assert longs <= self.active, f"handlers missing for {longs - self.active}"
        assert self.active - longs <= shorts, f"unexpected handlers {self.active - longs - shorts}"

    def teardown(self) -> None:
        async def close() -> None:
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            if self.client is not None:
                await self.client.aclose()
            await self.server.aclose()

        try:
            self.loop.run_until_complete(close())
        finally:
            self.loop.close()


EXAMPLES = max(10, settings().max_examples // 2)


class TcpRequestReply(RequestReply):
    transport = "tcp"


TestMemRequestReply = RequestReply.TestCase
TestMemRequestReply.settings = settings(max_examples=EXAMPLES, stateful_step_count=15)
TestTcpRequestReply = TcpRequestReply.TestCase
TestTcpRequestReply.settings = settings(max_examples=EXAMPLES, stateful_step_count=15)
