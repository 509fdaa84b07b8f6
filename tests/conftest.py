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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# ---------------------------------------------------------------- leak checks
# Every ZeroMQ socket and context created while a test runs must be closed by its end, and
# every child process it started must be gone (pyzmq's own test suite does the same).

import multiprocessing.forkserver  # noqa: E402
import multiprocessing.resource_tracker  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402
import zmq  # noqa: E402

_created: list[Any] | None = None


def _recording(init: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if _created is not None:
            _created.append(self)

    return wrapper


zmq.Socket.__init__ = _recording(zmq.Socket.__init__)  # type: ignore[method-assign]
zmq.Context.__init__ = _recording(zmq.Context.__init__)  # type: ignore[method-assign]


def _helper_pids() -> set[int]:
    """multiprocessing's long-lived helpers, started on first use and kept on purpose."""
    pids = {
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
    }
    return {pid for pid in pids if pid}


def _live_children() -> dict[int, psutil.Process]:
    alive = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive[child.pid] = child
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves a ZeroMQ socket or context open or a child process running."""
    global _created
    before = set(_live_children())
    _created = []
    try:
        yield
    finally:
        created, _created = _created, None
        problems = [f"unclosed {type(obj).__name__}" for obj in created if not obj.closed]
        for obj in created:
            if not obj.closed:
                obj.close(linger=0) if isinstance(obj, zmq.Socket) else obj.destroy(linger=0)
        stray = {
            pid: child
            for pid, child in _live_children().items()
            if pid not in before and pid not in _helper_pids()
        }
        for child in stray.values():
            try:
                problems.append(f"child process {child.pid} ({' '.join(child.cmdline()[:3])})")
                child.kill()
            except psutil.NoSuchProcess:
                continue
        if problems:
            pytest.fail("test leaked: " + "; ".join(problems))
