"""A TCPStore server that listens on one address.

torch's TCPStore server listens on every interface whatever host it is given (the host
only tells the store's own client where to connect), and the store has no authentication:
anyone who reaches its port reads and writes the job's keys. :func:`host_store` binds the
listening socket itself, on the address the job's clients are told — loopback for a job
on one machine, ``MASTER_ADDR`` under torchrun — and hands it to the store.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

__all__ = ["host_store"]

_BACKLOG = 512


def host_store(host: str, port: int, *, timeout_s: float, multi_tenant: bool = False) -> TCPStore:
    """The server of a TCPStore listening on ``host``'s first address only (``port`` 0:
    any free one; the store's ``port`` says which). Runs on the caller's thread.

    Raises OSError when ``host`` does not resolve or is not an address of this machine
    (``EADDRNOTAVAIL``), or the port is taken; what TCPStore raises otherwise.
    """
    from torch._C._distributed_c10d import TCPStore

    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(_BACKLOG)
        bound = int(listener.getsockname()[1])
        # The store owns a duplicate; this socket closes on leaving.
        fd = os.dup(listener.fileno())
    try:
        return TCPStore(
            host, bound, is_master=True, wait_for_workers=False, multi_tenant=multi_tenant,
            timeout=timedelta(seconds=timeout_s), master_listen_fd=fd,
        )  # fmt: skip
    except BaseException:
        _close_if_listening(fd, bound)
        raise


def _close_if_listening(fd: int, port: int) -> None:
    """Close ``fd`` when it is still the socket listening on ``port`` (a store that refused
    it may or may not have closed it; a closed number may already name another file)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return  # closed already
    if sock.getsockname()[1] == port:
        sock.close()
    else:
        sock.detach()
