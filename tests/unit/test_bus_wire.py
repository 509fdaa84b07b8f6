"""docs/wire.md is enough: a client built from it with plain pyzmq and msgpack (a separate
process that imports nothing from dynarl) registers and exchanges every kind of frame;
and the document lists every message, field and error code the code has."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import msgpack
import msgspec

from dynarl.bus import BusConfig, BusServer, ComponentReport, Interrupt, Peer, PeerEvent, run
from dynarl.bus._messages import Ack, ControlMessage, DataMessage, EventMessage
from dynarl.bus._report_records import RejectedCandidate
from dynarl.bus._stats import BAD_FRAME_REASONS

ROOT = Path(__file__).parent.parent.parent
WIRE = (ROOT / "docs" / "wire.md").read_text()
CLIENT = Path(__file__).parent / "raw_wire_client.py"


def test_a_client_written_from_the_document_alone() -> None:
    reports: list[ComponentReport] = []
    events: list[str] = []
    hung = asyncio.Event()
    cancelled = asyncio.Event()

    async def interrupt(message: Interrupt, peer: Peer) -> Ack:
        hung.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Ack()

    def report(message: ComponentReport, peer: Peer) -> Ack:
        reports.append(message)
        return Ack()

    async def main() -> dict[str, object]:
        registered = asyncio.Event()

        def on_peer(event: PeerEvent) -> None:
            events.append(event.event)
            if event.event == "registered":
                registered.set()

        config = BusConfig(heartbeat_interval_s=1.0)
        async with asyncio.timeout(60), BusServer(config=config, on_peer=on_peer) as server:
            server.route(Interrupt, interrupt)
            server.route(ComponentReport, report)
            raw = await asyncio.create_subprocess_exec(
                sys.executable, "-I", str(CLIENT), server.address, stdout=asyncio.subprocess.PIPE
            )
            await registered.wait()
            answer = await server.request("raw", Interrupt(component="from-server"), timeout=30)
            assert answer == Ack(detail="interrupted from-server")
            out, _ = await raw.communicate()
            assert raw.returncode == 0
            # The CANCEL may overtake the handler's first step, which then never runs.
            assert server.stats.cancelled == 1
            if hung.is_set():
                await cancelled.wait()
            result: dict[str, object] = json.loads(out)
            return result

    seen = run(main())
    assert reports == [
        ComponentReport(
            component="rollout", kind="rollout", time=12.5, interval_s=1.0, utilization=(0.25, 0.75)
        )
    ]
    assert events == ["registered", "left"]
    assert seen["echoes"] == 2  # both heartbeats echoed


def documented_fields(name: str) -> list[str]:
    section = WIRE.split(f"#### `{name}`\n", 1)[1]
    for heading in ("\n#### ", "\n### ", "\n## "):
        section = section.split(heading, 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, flags=re.M)


def test_the_document_lists_every_message_and_field() -> None:
    unions = (ControlMessage, DataMessage, EventMessage)
    for struct in {member for union in unions for member in union.__args__} | {RejectedCandidate}:
        fields = documented_fields(struct.__name__)
        expected = list(struct.__struct_fields__)
        if struct.__struct_config__.tag:
            expected = ["type", *expected]
        assert fields == expected, struct.__name__


def test_the_document_lists_every_decision_reason() -> None:
    import dynarl.bus as bus

    section = WIRE.split("#### Reason maps", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(\w+)`", section))
    types = {m for u in (bus.DecisionReason, bus.CandidateReason) for m in u.__args__}
    types |= {m for m in bus.RejectionReason.__args__}
    names = {t.__name__ for t in types} | {f for t in types for f in t.__struct_fields__}
    assert names <= documented, sorted(names - documented)


def test_the_document_lists_every_error_code() -> None:
    codes = set(re.findall(r"^\| `(\w+)` \| .* \| `\w+` \|$", WIRE, flags=re.M))
    assert codes == {*BAD_FRAME_REASONS, "deadline_exceeded", "bad_request", "handler_error"}


def test_the_documented_bytes_are_the_bytes() -> None:
    hex_bytes = WIRE.split("Bytes on the wire for the `Ping` request above", 1)[1]
    shown = bytes.fromhex(hex_bytes.split("```", 2)[1].removeprefix("text"))
    frame = [1, 2, 5000, {"type": "Ping", "seq": 7, "payload": b"hi"}]
    assert shown == msgpack.packb(frame, use_bin_type=True)
    assert msgspec.msgpack.decode(shown)[3]["type"] == "Ping"
