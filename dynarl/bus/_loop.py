"""The event loop dynarl runs on, and the one bridge for blocking callers.

:func:`new_event_loop` picks uvloop when it is installed (set ``DYNARL_EVENT_LOOP=asyncio``
to force the standard loop); :func:`run` runs a coroutine on such a loop from synchronous
code. :class:`SyncBridge` runs one loop in a background thread so that blocking code (a
trainer step, a test) can call coroutines without nesting ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from dynarl.errors import DeadlineExceeded

__all__ = ["SyncBridge", "loop_name", "new_event_loop", "run"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ENV = "DYNARL_EVENT_LOOP"


def _want_uvloop() -> bool:
    choice = os.environ.get(_ENV, "auto")
    if choice not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"{_ENV} must be 'auto', 'uvloop' or 'asyncio', got {choice!r}")
    return choice != "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when installed and not disabled, else asyncio's.

    Raises ValueError for a bad ``DYNARL_EVENT_LOOP``; ImportError if it says ``uvloop``
    and uvloop is not installed.
    """
    if _want_uvloop():
        try:
            import uvloop
        except ImportError:
            if os.environ.get(_ENV) == "uvloop":
                raise
        else:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
    return asyncio.new_event_loop()


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: what :func:`new_event_loop` returns here."""
    loop = new_event_loop()
    try:
        return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
    finally:
        loop.close()


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a new loop from :func:`new_event_loop`.

    Raises RuntimeError if called from a running event loop (use ``await`` there, or a
    :class:`SyncBridge` from a thread).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        main.close()
        raise RuntimeError("run() cannot be called from a running event loop; await instead")
    with asyncio.Runner(loop_factory=new_event_loop, debug=debug) as runner:
        return runner.run(main)


class SyncBridge:
    """One event loop in a background thread that blocking callers submit coroutines to.

    Use as a context manager (or call :meth:`start` and :meth:`close`). :meth:`run` blocks
    the calling thread until the coroutine finishes; it must not be called from the
    bridge's own loop (that would deadlock), and raises RuntimeError if it is.
    """

    def __init__(self, *, name: str = "dynarl-bridge") -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    def start(self) -> SyncBridge:
        """Start the loop thread; returns self. Raises RuntimeError if already started."""
        if self._thread is not None:
            raise RuntimeError("SyncBridge already started")
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise RuntimeError("SyncBridge loop failed to start") from self._failure
        logger.debug("sync bridge %s started", self._name)
        return self

    def _main(self) -> None:
        try:
            run(self._serve())
        except BaseException as exc:  # the thread's boundary: record and re-raise
            self._failure = exc
            self._ready.set()
            raise

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()

    def run(self, coro: Coroutine[Any, Any, T], *, timeout: float | None = None) -> T:
        """Run ``coro`` on the bridge's loop and return its result (or raise its error).

        Raises DeadlineExceeded (and cancels the coroutine) if ``timeout`` seconds pass,
        RuntimeError if the bridge is not running or if called from its own loop.
        """
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("SyncBridge is not running")
        if threading.get_ident() == self._thread.ident:
            coro.close()
            raise RuntimeError("SyncBridge.run called from the bridge's own loop")
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"bridged call did not finish within {timeout} s") from None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop (cancelling what still runs on it) and join its thread."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None and thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"SyncBridge thread did not stop within {timeout} s")
        self._thread = None
        logger.debug("sync bridge %s stopped", self._name)

    def __enter__(self) -> SyncBridge:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
