"""CURVE: key files, loopback-only plain binds, allow-listed clients, refused strangers."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dynarl.bus import (
    BusClient,
    BusConfig,
    BusServer,
    CurveClient,
    CurveServer,
    Publisher,
    generate_keys,
    load_public_key,
    load_secret_key,
    run,
)
from dynarl.bus._messages import Ping, Pong
from dynarl.bus._transport import check_bind_address
from dynarl.cli import main as cli
from dynarl.errors import DeadlineExceeded

CONFIG = BusConfig(heartbeat_interval_s=0.2, register_timeout_s=0.5)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    return {name: generate_keys(tmp_path, name) for name in ("server", "alice", "mallory")}


def test_key_files_and_modes(tmp_path: Path) -> None:
    public, secret = generate_keys(tmp_path / "keys", "node-1")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) & 0o077 == 0o044
    pub, sec = load_secret_key(secret)
    assert pub == load_public_key(public) and len(sec) == 40
    assert zmq.curve_public(sec) == pub
    assert zmq.auth.load_certificate(secret) == (pub, sec)  # ZeroMQ's own format
    with pytest.raises(ValueError, match="refusing to overwrite"):
        generate_keys(tmp_path / "keys", "node-1")
    with pytest.raises(ValueError, match="key name"):
        generate_keys(tmp_path, "../escape")


def test_a_readable_secret_key_file_is_refused(keys: dict[str, tuple[Path, Path]]) -> None:
    _, secret = keys["alice"]
    os.chmod(secret, 0o640)
    with pytest.raises(ValueError, match="mode 0640; it must be 0600 or stricter"):
        load_secret_key(secret)
    os.chmod(secret, 0o400)
    assert load_secret_key(secret)
    public = keys["alice"][0]
    os.chmod(public, 0o600)
    with pytest.raises(ValueError, match="no secret key"):
        load_secret_key(public)


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:0", "tcp://*:5555", "tcp://10.1.2.3:0"])
def test_routable_binds_require_curve(address: str) -> None:
    with pytest.raises(ValueError, match="requires CURVE"):
        check_bind_address(address, secured=False)
    assert check_bind_address(address, secured=True)

    async def main() -> None:
        with pytest.raises(ValueError, match="requires CURVE"):
            await BusServer(address).start()
        with pytest.raises(ValueError, match="requires CURVE"):
            async with Publisher(address):
                pass

    run(main())


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "tcp://localhost:0", "tcp://[::1]:0"])
def test_loopback_binds_without_curve(address: str) -> None:
    assert check_bind_address(address, secured=False).endswith(":*")


def test_only_allow_listed_clients_get_in(keys: dict[str, tuple[Path, Path]]) -> None:
    server_public = load_public_key(keys["server"][0])
    curve = CurveServer.from_files(keys["server"][1], [keys["alice"][0]])

    async def main() -> None:
        # CURVE forced on over loopback: the same code path as a routable bind.
        async with BusServer(config=CONFIG, curve=curve) as server:
            alice = CurveClient(key_file=keys["alice"][1], server_key=server_public)
            async with BusClient(server.address, name="alice", config=CONFIG, curve=alice) as ok:
                assert await ok.request(Ping(seq=1)) == Pong(seq=1)
            mallory = CurveClient(key_file=keys["mallory"][1], server_key=server_public)
            with pytest.raises(DeadlineExceeded):
                await BusClient(
                    server.address, name="mallory", config=CONFIG, curve=mallory
                ).start()
            with pytest.raises(DeadlineExceeded):  # no CURVE at all
                await BusClient(server.address, name="plain", config=CONFIG).start()
            assert server.peers() == []
            assert await refused_at_handshake(server.address, keys["mallory"][1], server_public)

    run(main())


async def refused_at_handshake(address: str, secret_file: Path, server_key: bytes) -> bool:
    """Whether ZeroMQ reports an authentication failure to a client using this key.

    Async, because the server's ZAP handler runs on this same loop.
    """
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        socket.linger = 0
        socket.curve_publickey, socket.curve_secretkey = load_secret_key(secret_file)
        socket.curve_serverkey = server_key
        socket.connect(address)
        async with asyncio.timeout(10):
            event = parse_monitor_message(await monitor.recv_multipart())
        return bool(event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)
        socket.close(linger=0)
        context.term()


def test_keys_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["keys", "worker-7", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "worker-7.key_secret" in out and "0600" in out
    assert load_secret_key(tmp_path / "worker-7.key_secret")
    assert cli(["keys", "worker-7", "--dir", str(tmp_path)]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err
