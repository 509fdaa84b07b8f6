"""Publish/subscribe, the event loop helpers, the sync bridge and rate-limited logging."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from dynarl.bus import (
    BusConfig,
    ComponentReport,
    DecisionRecord,
    NoDonor,
    PeerEvent,
    Publisher,
    run,
)
from dynarl.bus._loop import SyncBridge, loop_name, new_event_loop
from dynarl.bus._pubsub import Subscriber
from dynarl.bus._stats import RateLimitedLog
from dynarl.errors import DeadlineExceeded

_names = itertools.count()


def decision(n: int) -> DecisionRecord:
    return DecisionRecord(
        decision_id=f"d{n}",
        time=float(n),
        committed=False,
        reason=NoDonor(),
        old_allocation={"rollout": 4},
        new_allocation={"rollout": 4},
    )


@pytest.mark.parametrize("transport", ["mem", "tcp"])
def test_publish_subscribe_by_topic_prefix(transport: str) -> None:
    async def main() -> None:
        where = f"mem://pub-{next(_names)}" if transport == "mem" else "tcp://127.0.0.1:0"
        async with Publisher(where) as publisher:
            async with Subscriber(publisher.address, topics=["ledger.", "probe"]) as subscriber:
                # A subscription takes a moment to reach a ZeroMQ publisher: probe until it has.
                async with asyncio.timeout(10):
                    while True:
                        publisher.publish("probe", PeerEvent(peer="p", event="registered", time=0))
                        try:
                            await subscriber.recv(timeout=0.05)
                            break
                        except DeadlineExceeded:
                            continue
                report = ComponentReport(
                    component="c", kind="rollout", time=1, interval_s=1, utilization=(0.5,)
                )
                publisher.publish("metrics.c", report)  # not subscribed
                publisher.publish("ledger.decisions", decision(1))
                topic, event = await subscriber.recv(timeout=5)
                while topic == "probe":
                    topic, event = await subscriber.recv(timeout=5)
                assert (topic, event) == ("ledger.decisions", decision(1))

    run(main())


def test_subscribers_count_and_skip_bad_frames() -> None:
    async def main() -> None:
        async with Publisher(f"mem://pub-{next(_names)}") as publisher:
            async with Subscriber(publisher.address) as subscriber:
                link = publisher._link
                assert link is not None
                link.send(b"t", b"\xc1")
                link.send(b"\xff", b"\x80")
                publisher.publish("t", decision(2))
                assert await subscriber.recv(timeout=5) == ("t", decision(2))
                assert subscriber.stats.bad_frames == {"malformed": 2}

    run(main())


def test_event_loop_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    assert loop_name() == "uvloop"
    monkeypatch.setenv("DYNARL_EVENT_LOOP", "asyncio")
    assert loop_name() == "asyncio"
    loop = new_event_loop()
    try:
        assert isinstance(loop, asyncio.BaseEventLoop)
    finally:
        loop.close()
    monkeypatch.setenv("DYNARL_EVENT_LOOP", "tokio")
    with pytest.raises(ValueError, match="DYNARL_EVENT_LOOP"):
        new_event_loop()


def test_sync_bridge_runs_coroutines_for_blocking_callers() -> None:
    async def double(x: int) -> int:
        await asyncio.sleep(0)
        return 2 * x

    async def nested(bridge: SyncBridge) -> int:
        return bridge.run(double(1))

    with SyncBridge() as bridge:
        assert bridge.run(double(21)) == 42
        with pytest.raises(DeadlineExceeded):
            bridge.run(asyncio.sleep(10), timeout=0.05)
        with pytest.raises(RuntimeError, match="own loop"):
            bridge.run(nested(bridge))
        with pytest.raises(ZeroDivisionError):
            bridge.run(_fail())
    with pytest.raises(RuntimeError, match="not running"):
        bridge.run(double(1))


async def _fail() -> None:
    raise ZeroDivisionError


def test_run_refuses_a_running_loop() -> None:
    async def inner() -> None:
        with pytest.raises(RuntimeError, match="running event loop"):
            run(asyncio.sleep(0))

    run(inner())


def test_rate_limited_log_counts_what_it_holds_back(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("test.ratelimit"), 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        written = [log.warning("malformed", "bad frame %d", n) for n in range(100)]
        log.warning("oversize", "big frame")
        now[0] = 10.5
        log.warning("malformed", "bad frame %d", 100)
    assert written == [True] + [False] * 99
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "bad frame 0",
        "big frame",
        "bad frame 100 (and 99 more like it in the last 10 s)",
    ]
    assert BusConfig().log_interval_s == 10.0
