"""A bus client written from docs/wire.md alone: plain pyzmq and msgpack, no dynarl.

Run as ``python raw_wire_client.py ADDRESS``; exits 0 after every exchange went as the
document says, and prints one JSON line of what it saw.
"""

from __future__ import annotations

import json
import struct
import sys
from typing import Any

import msgpack
import zmq

REQUEST, REPLY, NOTIFY, CANCEL = 1, 2, 3, 4


class RawClient:
    def __init__(self, address: str, name: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.rcvtimeo = 10_000
        self.socket.setsockopt(zmq.ROUTING_ID, name.encode())
        self.socket.connect(address)
        self.next_id = 0
        self.inbox: list[list[Any]] = []
        self.echoes = 0

    def send(self, kind: int, rid: int, timeout_ms: int, body: Any) -> None:
        self.socket.send(msgpack.packb([kind, rid, timeout_ms, body], use_bin_type=True))

    def receive(self) -> list[Any]:
        frame = msgpack.unpackb(self.socket.recv(), raw=False)
        assert isinstance(frame, list) and len(frame) == 4, frame
        return frame

    def call(self, body: dict[str, Any], timeout_ms: int = 10_000) -> dict[str, Any]:
        """Send a REQUEST and return the body of its REPLY, keeping other frames aside."""
        self.next_id += 1
        self.send(REQUEST, self.next_id, timeout_ms, body)
        while True:
            kind, rid, _, reply = self.receive()
            if kind == REPLY and rid == self.next_id:
                return dict(reply)
            self.keep(kind, rid, reply)

    def keep(self, kind: int, rid: int, body: Any) -> None:
        if kind == NOTIFY and body["type"] == "Heartbeat":
            self.echoes += 1
        else:
            self.inbox.append([kind, rid, body])

    def heartbeat(self, seq: int) -> None:
        self.send(NOTIFY, 0, 0, {"type": "Heartbeat", "seq": seq, "time": 0.0})

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def main(address: str) -> dict[str, Any]:
    client = RawClient(address, "raw")
    try:
        welcome = client.call({"type": "Register", "protocol": 1, "name": "raw", "role": "raw"})
        assert welcome["type"] == "Welcome" and welcome["protocol"] == 1, welcome
        client.heartbeat(0)

        report = {
            "type": "ComponentReport",
            "component": "rollout",
            "kind": "rollout",
            "time": 12.5,
            "interval_s": 1.0,
            "utilization": [0.25, 0.75],
        }  # optional fields left out: the decoder fills their defaults
        assert client.call(report) == {"type": "Ack", "detail": ""}

        tokens = struct.pack("<4i", 101, 7, -1, 2**31 - 1)
        sample = {"type": "Sample", "sample_id": "raw-1", "token_ids": tokens, "prompt_len": 2}
        put = {"type": "ChannelPut", "channel": "samples", "key": "k", "item": sample}
        assert client.call({**put, "capacity": 4})["type"] == "Ack"
        got = client.call({"type": "ChannelGet", "channel": "samples", "key": "k", "capacity": 4})
        assert got["type"] == "ChannelItem" and got["item"]["token_ids"] == tokens, got
        assert struct.unpack("<4i", got["item"]["token_ids"])[3] == 2**31 - 1

        refused = client.call({"type": "NoSuchMessage"})
        assert refused["type"] == "ErrorReply" and refused["code"] == "unknown_tag", refused
        wrong = client.call({"type": "Ping", "seq": "seven"})
        assert wrong["code"] == "invalid" and "$.seq" in wrong["message"], wrong

        # The server asks us something: answer its REQUEST with a REPLY of the same id.
        assert client.call({"type": "Ping", "seq": 1}) == {"type": "Pong", "seq": 1, "payload": b""}
        while not client.inbox:
            kind, rid, _, body = client.receive()
            client.keep(kind, rid, body)
        kind, rid, question = client.inbox.pop(0)
        assert kind == REQUEST and question["type"] == "Interrupt", question
        client.send(
            REPLY, rid, 0, {"type": "Ack", "detail": "interrupted " + question["component"]}
        )

        # Start a request the server will sit on, then cancel it.
        client.next_id += 1
        client.send(REQUEST, client.next_id, 60_000, {"type": "Interrupt", "component": "hang"})
        client.heartbeat(1)
        assert client.call({"type": "Ping", "seq": 2})["seq"] == 2  # server is working on it
        client.send(CANCEL, client.next_id - 1, 0, None)
        assert client.call({"type": "Ping", "seq": 3})["seq"] == 3

        client.send(NOTIFY, 0, 0, {"type": "Unregister", "reason": "done"})
        gone = client.call({"type": "Ping", "seq": 4})  # the server has forgotten us
        assert gone["type"] == "ErrorReply" and gone["code"] == "not_registered", gone
        assert not any(name.startswith("dynarl") for name in sys.modules), "imported dynarl"
        return {"welcome": welcome, "echoes": client.echoes}
    finally:
        client.close()


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1]), default=repr) + "\n")
