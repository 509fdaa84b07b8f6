"""The conftest leak check also fails tests that leave a TCPStore server, a listening
socket or an asyncio task behind (see ``test_leak_fixture.py`` for sockets, contexts and
processes), and passes tests that close them, or a store a fixture hands them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MARKER = "# ---------------------------------------------------------------- leak checks"

LEAKY = """
import asyncio, socket
import pytest
from torch._C._distributed_c10d import TCPStore

KEEP = []

def new_store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

def test_leaks_a_listening_socket():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    KEEP.append(listener)

def test_leaks_a_store_server():
    KEEP.append(new_store())

def test_leaks_a_task():
    async def main():
        asyncio.get_running_loop().create_task(asyncio.sleep(60))
    asyncio.run(main())

def test_leaks_a_task_on_a_loop_left_open():
    loop = asyncio.new_event_loop()
    KEEP.append(loop)
    loop.create_task(asyncio.sleep(60))

@pytest.fixture
def store():
    yield new_store()

def test_a_fixtures_store_is_not_a_leak(store):
    assert store.port

def test_clean():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        server.close()
        await server.wait_closed()
        asyncio.create_task(asyncio.sleep(60)).cancel()  # ends within the grace period
    asyncio.run(main())
    store = new_store()
    del store
"""


def test_stores_sockets_and_tasks_left_fail_the_test(tmp_path: Path) -> None:
    # The leak-check section of the real conftest, without the rest.
    conftest = (Path(__file__).parent.parent / "conftest.py").read_text()
    section = conftest[conftest.index(MARKER) :]
    (tmp_path / "conftest.py").write_text("import pytest\n" + section)
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    out = result.stdout
    for name, finding in (
        ("test_leaks_a_listening_socket", "listening socket 127.0.0.1:"),
        ("test_leaks_a_store_server", "TCPStore server on port"),
        ("test_leaks_a_task", "(sleep) still running when its loop ended"),
        ("test_leaks_a_task_on_a_loop_left_open", "(sleep) on a loop left open"),
    ):
        assert f"ERROR at teardown of {name}" in out, out
        assert finding in out, out
    assert "of test_a_fixtures_store_is_not_a_leak" not in out, out
    assert "of test_clean" not in out and "4 errors" in out, out
