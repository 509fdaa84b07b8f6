"""Shared test configuration: hypothesis profiles and the markers' skip rules."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "nightly",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# The files that take longest (about a minute or more on 2 cores, `--durations`), run first:
# `make test` hands whole files to two xdist processes in collection order, and a long
# file started last would leave the other process idle at the end.
_LONGEST_FIRST = (
    # One xdist process takes every engine test (see pytest_xdist_make_scheduler): first,
    # so that its servers start, serve and stop while the other process runs other files.
    "tests/engines/test_engine_rollout.py",
    "tests/engines/test_vllm_engine.py",
    "tests/engines/test_weight_push.py",
    "tests/unit/test_sim_validation.py",
    "tests/dist/test_fault_injection.py",
    "tests/dist/test_reference_job.py",
    "tests/unit/test_docs.py",
    "tests/dist/test_hybrid_job.py",
    "tests/dist/test_torchrun_launch.py",
    "tests/dist/test_megatron_reshard.py",
    "tests/dist/test_reference_tolerance.py",
)


def _longest_first(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return _LONGEST_FIRST.index(path) if path in _LONGEST_FIRST else len(_LONGEST_FIRST)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, except that every file under ``tests/engines/`` goes to one
    process: they share that process's session-scoped engine servers (~3 GiB and half a
    minute each to start)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class EnginesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "tests/engines" if path.startswith("tests/engines/") else path

    return EnginesTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_longest_first)  # stable: every other test keeps its order
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every figure matplotlib is asked to close during the test, in order, left open for the
    test to read its axes (the charts' tests); closed at the end."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    close = plt.close
    kept: list[Any] = []
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for figure in kept:
        close(figure)


# ---------------------------------------------------------------- leak checks
# What a test opens it closes by its end (pyzmq's own test suite checks the same way): every
# ZeroMQ socket and context; every child process; every TCPStore server; every socket the
# process listens on; every asyncio task, which must be finished when the test's event loop
# ends (asyncio.run would otherwise cancel it silently), and on any loop the test leaves open.
# Processes and sockets that are closing get a short grace period.

import asyncio  # noqa: E402
import asyncio.runners  # noqa: E402
import gc  # noqa: E402
import multiprocessing.forkserver  # noqa: E402
import multiprocessing.resource_tracker  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402
import zmq  # noqa: E402

_GRACE_S = 2.0
_created: list[Any] | None = None
_stores: list[tuple[weakref.ref[Any], bool]] | None = None
"""TCPStores made during the test, each with whether it hosts the server."""
_loops: list[weakref.ref[asyncio.AbstractEventLoop]] | None = None
_tasks_left: list[str] | None = None
"""Tasks still running when an asyncio.Runner (asyncio.run) ended its loop."""


def _recording(init: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if _created is not None:
            _created.append(self)

    return wrapper


zmq.Socket.__init__ = _recording(zmq.Socket.__init__)  # type: ignore[method-assign]
zmq.Context.__init__ = _recording(zmq.Context.__init__)  # type: ignore[method-assign]


def _track_stores() -> None:
    """Record every TCPStore made from now on (once torch's c10d is loaded: not imported
    here, it is slow)."""
    store_type = getattr(sys.modules.get("torch._C._distributed_c10d"), "TCPStore", None)
    if store_type is None or getattr(store_type.__init__, "leak_tracked", False):
        return
    init = store_type.__init__

    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if _stores is not None:
            master = kwargs.get("is_master", args[3] if len(args) > 3 else False)
            _stores.append((weakref.ref(self), bool(master)))

    tracked.leak_tracked = True  # type: ignore[attr-defined]
    store_type.__init__ = tracked


def _track_loop(init: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if _loops is not None:
            _loops.append(weakref.ref(self))

    return wrapper


def _track_new_loop(new: Callable[[], Any]) -> Callable[[], Any]:
    def wrapper() -> Any:
        loop = new()
        if _loops is not None:
            _loops.append(weakref.ref(loop))
        return loop

    return wrapper


asyncio.BaseEventLoop.__init__ = _track_loop(asyncio.BaseEventLoop.__init__)  # type: ignore[method-assign]
try:
    import uvloop
except ImportError:
    pass
else:
    uvloop.new_event_loop = _track_new_loop(uvloop.new_event_loop)


def _describe(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    name = getattr(coro, "__qualname__", type(coro).__name__)
    return f"asyncio task {task.get_name()} ({name})"


def _running(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[Any]]:
    return [task for task in asyncio.all_tasks(loop) if not task.done()]


_cancel_all_tasks = asyncio.runners._cancel_all_tasks  # type: ignore[attr-defined]


def _cancel_left_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio.Runner's clean-up: first note the tasks still running (a task already asked
    to stop gets the grace period to finish)."""
    left = _tasks_left
    if left is not None:
        running = _running(loop)
        stopping = [task for task in running if task.cancelling()]
        if stopping:
            loop.run_until_complete(asyncio.wait(stopping, timeout=_GRACE_S))
            running = _running(loop)
        left.extend(f"{_describe(task)} still running when its loop ended" for task in running)
    _cancel_all_tasks(loop)


asyncio.runners._cancel_all_tasks = _cancel_left_tasks  # type: ignore[attr-defined]


def _helper_pids() -> set[int]:
    """multiprocessing's long-lived helpers, started on first use and kept on purpose."""
    pids = {
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
    }
    return {pid for pid in pids if pid}


def _descendants() -> list[psutil.Process]:
    """Every process below this one: read from ``/proc/<pid>/task/<tid>/children`` where
    Linux has it (a few reads, against psutil's scan of all of ``/proc``: ~16 ms a call,
    twice per test)."""
    if not Path("/proc/self/task").is_dir():
        return psutil.Process().children(recursive=True)
    found: list[psutil.Process] = []
    queue = [os.getpid()]
    while queue:
        pid = queue.pop()
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                for child in (task / "children").read_text().split():
                    found.append(psutil.Process(int(child)))
                    queue.append(int(child))
        except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess):
            continue  # it exited while we looked
    return found


def _live_children() -> dict[int, psutil.Process]:
    alive = {}
    for child in _descendants():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive[child.pid] = child
        except psutil.NoSuchProcess:
            continue
    return alive


def _listening() -> dict[tuple[str, int], int]:
    """``{(address, port): fd}`` of this process's listening TCP sockets."""
    return {
        (conn.laddr.ip, conn.laddr.port): conn.fd
        for conn in psutil.Process().net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    }


def _within_grace(check: Callable[[], list[str]]) -> list[str]:
    """``check()``'s findings once they last the grace period (one GC pass on the way:
    an object dropped without being closed is freed, not leaked, when nothing holds it)."""
    deadline = time.monotonic() + _GRACE_S
    found = check()
    if found:
        gc.collect()
    while found and time.monotonic() < deadline:
        time.sleep(0.05)
        found = check()
    return found


def _store_servers(stores: list[tuple[weakref.ref[Any], bool]], handed: list[Any]) -> list[Any]:
    """The TCPStore servers still alive, but those in ``handed``."""
    alive = [ref() for ref, master in stores if master]
    return [s for s in alive if s is not None and not any(s is h for h in handed)]


def _open_loops(loops: list[weakref.ref[asyncio.AbstractEventLoop]]) -> list[str]:
    found = []
    for ref in loops:
        loop = ref()
        if loop is not None and not loop.is_closed():
            found += [f"{_describe(t)} on a loop left open" for t in _running(loop)]
    return found


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a ZeroMQ socket or context open, a child process running, a
    TCPStore server alive, a socket listening or an asyncio task running."""
    global _created, _stores, _loops, _tasks_left
    _track_stores()
    before = set(_live_children())
    listening = set(_listening())
    _created, _stores, _loops, _tasks_left = [], [], [], []
    try:
        yield
    finally:
        created, _created = _created, None
        stores, _stores = _stores, None
        loops, _loops = _loops, None
        tasks_left, _tasks_left = _tasks_left, None
        problems = [f"unclosed {type(obj).__name__}" for obj in created if not obj.closed]
        for obj in created:
            if not obj.closed:
                obj.close(linger=0) if isinstance(obj, zmq.Socket) else obj.destroy(linger=0)
        problems += tasks_left + _open_loops(loops)
        handed = list((getattr(request.node, "funcargs", None) or {}).values())
        kept = {s.port for s in _store_servers(stores, []) if any(s is h for h in handed)}
        # A fixture's store (kept) is released with the test's arguments, after this check.
        servers = _within_grace(
            lambda: [f"TCPStore server on port {s.port}" for s in _store_servers(stores, handed)]
        )
        problems += servers
        # Megatron's DDP on gloo leaves one listener per trainer alive in native code (no
        # Python object holds it after gc: see the marker's tests); those tests are exempt
        # from this one check only.
        if request.node.get_closest_marker("gloo_listener_outlives_test") is None:
            problems += _within_grace(
                lambda: [
                    f"listening socket {host}:{port} (fd {fd})"
                    for (host, port), fd in _listening().items()
                    if (host, port) not in listening and port not in kept
                ]
            )
        problems += _stray_children(before)
        if problems:
            pytest.fail("test leaked: " + "; ".join(problems))


def _stray_children(before: set[int]) -> list[str]:
    """Child processes started during the test still running after the grace period
    (killed, so they do not outlive the run)."""
    stray = [
        child
        for pid, child in _live_children().items()
        if pid not in before and pid not in _helper_pids()
    ]
    _, alive = psutil.wait_procs(stray, timeout=_GRACE_S) if stray else ([], [])
    found = []
    for child in alive:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            found.append(f"child process {child.pid} ({' '.join(child.cmdline()[:3])})")
            child.kill()
        except psutil.NoSuchProcess:
            continue
    return found
