"""WorkerLauncher: who starts a job's worker processes.

A :class:`~dynarl.runtime.Job` builds its controller the same way wherever it runs; only
this differs. The :class:`~dynarl.runtime.launch.LocalLauncher` spawns one process per
device on this machine; under torchrun every rank already runs a worker, so the launcher
of ``python -m dynarl.runtime.launch`` only opens the rendezvous to them. The launcher
also says where the controller's bus binds, with which CURVE settings, and over which
store the workers build their process groups. Runs on the controller's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, Self

from dynarl.bus import CurveServer
from dynarl.runtime.worker import WorkerOptions

if TYPE_CHECKING:
    from types import TracebackType

    from torch._C._distributed_c10d import Store

__all__ = ["WorkerLauncher"]


class WorkerLauncher(Protocol):
    """What a :class:`~dynarl.runtime.Job` needs of whoever starts its workers.

    The job enters it before its controller (so workers are told to leave over the bus
    before it stops their processes) and calls :meth:`start` once the controller's bus is
    bound.
    """

    @property
    def store(self) -> Store | None:
        """The job's store when the launcher holds one (torchrun), else None: the
        controller hosts a TCPStore on loopback."""
        ...

    @property
    def bind(self) -> str:
        """The address the controller's bus binds (port 0: any free one)."""
        ...

    @property
    def curve(self) -> CurveServer | None:
        """CURVE settings of the controller's bus (None: plain TCP, loopback only)."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def start(self, workers: Sequence[WorkerOptions]) -> None:
        """Start (or let in) the worker of each ``workers[i].device``; they register
        with the controller at ``workers[i].controller`` by themselves.

        Raises WorkerError when a worker cannot be started.
        """
        ...

    def check(self) -> None:
        """Raise WorkerError naming a worker this launcher started that has exited."""
        ...

    def exited(self) -> tuple[int, ...]:
        """Devices whose worker process, started here, has exited (to start again)."""
        ...

    def kill(self, device: int) -> None:
        """SIGKILL ``device``'s worker (fault injection). Raises WorkerError where the
        launcher cannot."""
        ...

    def pids(self) -> dict[int, int]:
        """``{device: pid}`` of the worker processes started here still running."""
        ...
