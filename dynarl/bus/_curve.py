"""CURVE security for routable binds: key files, allow-lists and the ZAP authenticator.

Each node owns a key pair in two files, provisioned outside the job (``dynarl keys``):
``<name>.key`` (public, shareable) and ``<name>.key_secret`` (secret, mode 0600). The file
format is ZeroMQ's certificate format, so ``zmq.auth.load_certificate`` reads them too.
Only public keys are exchanged; a server accepts exactly the client public keys on its
allow-list and refuses every other handshake.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth import Authenticator
from zmq.utils import z85

__all__ = [
    "CurveClient",
    "CurveServer",
    "generate_keys",
    "load_public_key",
    "load_secret_key",
]

logger = logging.getLogger(__name__)

_DOMAIN = "dynarl"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_KEY = re.compile(rb'^\s*(public|secret)-key\s*=\s*"?([^"\s]+)"?\s*$')
_BANNER = "#   ZeroMQ CURVE {what} Certificate, written by dynarl\n\nmetadata\ncurve\n"


def _check_key(key: bytes, what: str) -> bytes:
    if len(key) != 40:
        raise ValueError(f"{what} must be a 40-character Z85 CURVE key, got {len(key)} bytes")
    try:
        z85.decode(key)
    except (ValueError, KeyError):
        raise ValueError(f"{what} is not valid Z85") from None
    return key


def _parse(text: bytes, path: Path) -> dict[str, bytes]:
    keys: dict[str, bytes] = {}
    for line in text.splitlines():
        match = _KEY.match(line)
        if match:
            keys[match.group(1).decode()] = match.group(2)
    if "public" not in keys:
        raise ValueError(f"no public key in {path}")
    return keys


def generate_keys(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write a new key pair ``<name>.key`` and ``<name>.key_secret`` (mode 0600).

    Returns (public key file, secret key file). Raises ValueError for a bad name or if
    either file exists already (keys are never overwritten).
    """
    if not _NAME.match(name):
        raise ValueError(f"key name must match {_NAME.pattern}, got {name!r}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists():
            raise ValueError(f"{path} exists; refusing to overwrite a key")
    public, secret = zmq.curve_keypair()
    pub_line = f'    public-key = "{public.decode()}"\n'
    secret_text = _BANNER.format(what="**Secret**") + pub_line
    secret_text += f'    secret-key = "{secret.decode()}"\n'
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(secret_text)
    fd = os.open(public_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(_BANNER.format(what="Public") + pub_line)
    logger.info("generated CURVE key pair %s", folder / name)
    return public_path, secret_path


def load_secret_key(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a secret key file.

    Raises ValueError if the file is readable by group or others (its mode must be 0600
    or stricter), is not a regular file, or holds no valid key pair; OSError if unreadable.
    """
    file = Path(path)
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"secret key file {file} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise ValueError(
                f"secret key file {file} has mode {mode:04o}; it must be 0600 or stricter"
            )
        keys = _parse(handle.read(), file)
    if "secret" not in keys:
        raise ValueError(f"no secret key in {file}")
    return _check_key(keys["public"], f"public key in {file}"), _check_key(
        keys["secret"], f"secret key in {file}"
    )


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key in a key file (public or secret). Raises ValueError if none."""
    file = Path(path)
    return _check_key(_parse(file.read_bytes(), file)["public"], f"public key in {file}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CurveServer:
    """CURVE settings of a binding endpoint (server, publisher)."""

    key_file: Path
    """This node's secret key file (mode 0600 or stricter)."""
    allowed_clients: frozenset[bytes]
    """Z85 public keys of the clients allowed to connect; every other key is refused."""

    def __post_init__(self) -> None:
        for key in self.allowed_clients:
            _check_key(key, "an allowed client key")

    @classmethod
    def from_files(
        cls, key_file: str | os.PathLike[str], client_key_files: Iterable[str | os.PathLike[str]]
    ) -> CurveServer:
        """Settings from this node's secret key file and the clients' public key files."""
        allowed = frozenset(load_public_key(path) for path in client_key_files)
        return cls(key_file=Path(key_file), allowed_clients=allowed)


@dataclass(frozen=True, kw_only=True, slots=True)
class CurveClient:
    """CURVE settings of a connecting endpoint (client, subscriber)."""

    key_file: Path
    """This node's secret key file (mode 0600 or stricter)."""
    server_key: bytes
    """Z85 public key of the server to connect to."""

    def __post_init__(self) -> None:
        _check_key(self.server_key, "CurveClient.server_key")


def apply_client(socket: zmq.Socket[Any], curve: CurveClient) -> None:
    """Make ``socket`` a CURVE client of ``curve.server_key``."""
    public, secret = load_secret_key(curve.key_file)
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_serverkey = curve.server_key


class _AllowList:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self._keys
        if not allowed:
            logger.warning("refused a CURVE client whose public key is not allowed: %r", key)
        return allowed


class Guard:
    """The ZAP authenticator of one ZeroMQ context, accepting only allow-listed clients.

    Create it before binding a CURVE server socket, run :meth:`serve` in the endpoint's
    task group for as long as the socket lives, and :meth:`close` it after the socket.
    """

    def __init__(self, context: zmq.asyncio.Context, curve: CurveServer) -> None:
        self._curve = curve
        self._auth = Authenticator(context, log=logging.getLogger(f"{__name__}.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(_DOMAIN, _AllowList(curve.allowed_clients))

    def apply(self, socket: zmq.Socket[Any]) -> None:
        """Make ``socket`` a CURVE server with this node's keys."""
        public, secret = load_secret_key(self._curve.key_file)
        socket.curve_server = True
        socket.curve_publickey = public
        socket.curve_secretkey = secret
        socket.zap_domain = _DOMAIN.encode()

    async def serve(self) -> None:
        """Answer ZAP requests until cancelled (runs on the endpoint's loop)."""
        poller = zmq.asyncio.Poller()
        poller.register(self._auth.zap_socket, zmq.POLLIN)
        while True:
            await poller.poll()
            try:
                while True:
                    request = self._auth.zap_socket.recv_multipart(zmq.NOBLOCK)
                    await self._auth.handle_zap_message(request)
            except zmq.Again:
                pass

    def close(self) -> None:
        """Close the ZAP socket (after :meth:`serve` was cancelled)."""
        self._auth.stop()
