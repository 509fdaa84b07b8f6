"""The open/close pattern every dynarl resource shares, and named start-up stages.

:class:`AsyncResource` is the base of everything that opens something (a socket, a
server, a store, a file, child processes, background tasks): an async context manager
with :meth:`~AsyncResource.aclose` (anyio's ``AsyncResource``). A subclass implements
``_open(stack)``: each step opens one thing and registers on ``stack`` (a
:class:`contextlib.AsyncExitStack`) how to close it, right after opening it. When a step
raises, what the earlier steps opened is closed in reverse order before the error
propagates; :meth:`~AsyncResource.aclose`, or leaving the ``async with`` block, closes
everything in reverse order, once. Constructors do no I/O: opening is ``_open``'s.

:func:`background` is a task group for a resource's background loops (cancelled when it
closes); :func:`stage` names a start-up step in the error its failure raises.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Self, TypeVar

from dynarl.errors import DynarlError

__all__ = ["AsyncResource", "Background", "background", "stage"]

T = TypeVar("T")


class AsyncResource:
    """Base of an async context manager opened in steps on an ``AsyncExitStack``.

    Opens once: entering it again, open or closed, raises RuntimeError. Runs on the event
    loop that opens it.
    """

    _resource_stack: AsyncExitStack | None = None
    _resource_entered: bool = False

    async def _open(self, stack: AsyncExitStack) -> None:
        """Open the resource, registering each thing's close on ``stack`` as it opens."""
        raise NotImplementedError

    async def _open_resource(self) -> None:
        """Run :meth:`_open`; on failure close what it opened, in reverse order, and
        re-raise. Raises RuntimeError when the resource was already opened."""
        if self._resource_entered:
            raise RuntimeError(f"{type(self).__name__} opens once; it was already opened")
        self._resource_entered = True
        async with AsyncExitStack() as stack:
            await self._open(stack)
            self._resource_stack = stack.pop_all()

    async def aclose(self) -> None:
        """Close everything opened, in reverse order (idempotent)."""
        stack, self._resource_stack = self._resource_stack, None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> Self:
        await self._open_resource()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class Background:
    """The tasks of one :func:`background` group."""

    def __init__(self, group: asyncio.TaskGroup) -> None:
        self._group = group
        self._tasks: set[asyncio.Task[Any]] = set()

    def create_task(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``work`` in the group; it is cancelled when the group closes."""
        task = self._group.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel(self) -> None:
        """Cancel every task still running."""
        for task in self._tasks:
            task.cancel()


@contextlib.asynccontextmanager
async def background() -> AsyncIterator[Background]:
    """A task group for background loops: leaving it cancels them and waits for them.

    A crash of one of its tasks cancels the task that entered it and surfaces (in an
    ExceptionGroup) when the group closes. The exception that closes it is not handed to
    the task group (which would wrap it in an ExceptionGroup); it propagates unchanged.
    """
    failure: BaseException | None = None
    async with asyncio.TaskGroup() as group:
        tasks = Background(group)
        try:
            yield tasks
        except BaseException as exc:  # re-raised below, once the tasks have ended
            failure = exc
        finally:
            tasks.cancel()
    if failure is not None:
        raise failure


@contextlib.contextmanager
def stage(name: str, error: type[DynarlError]) -> Iterator[None]:
    """Run one start-up step: an Exception it raises becomes ``error`` with the message
    ``start-up failed at stage '<name>': <cause type>: <cause>``, chained to the cause.

    Cancellation and other BaseExceptions pass unchanged.
    """
    try:
        yield
    except Exception as exc:
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise error(f"start-up failed at stage {name!r}: {cause}") from exc
