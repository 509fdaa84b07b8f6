"""The conftest leak check fails tests that leave sockets, contexts or processes behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MARKER = "# ---------------------------------------------------------------- leak checks"

LEAKY = """
import subprocess, sys, zmq

def test_leaks_a_socket():
    context = zmq.Context()
    context.socket(zmq.DEALER)

def test_leaks_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

def test_clean():
    context = zmq.Context()
    context.socket(zmq.DEALER).close(linger=0)
    context.term()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def test_leaks_fail_the_test_and_clean_runs_pass(tmp_path: Path) -> None:
    # The leak-check section of the real conftest, without the rest (torch is slow to import).
    conftest = (Path(__file__).parent.parent / "conftest.py").read_text()
    section = conftest[conftest.index(MARKER) :]
    (tmp_path / "conftest.py").write_text("import pytest\n" + section)
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    out = result.stdout
    assert "unclosed Socket" in out and "unclosed Context" in out, out
    assert "child process" in out, out
    assert "ERROR at teardown of test_leaks_a_socket" in out, out
    assert "ERROR at teardown of test_leaks_a_process" in out, out
    assert "of test_clean" not in out and "2 errors" in out, out
