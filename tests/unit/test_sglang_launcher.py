"""SGLangServer starts a server process, waits for /health, and stops what it started.

The fake's command-line entry point stands in for ``sglang.launch_server``.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys

import pytest

from dynarl.backends.sglang import SGLangClient
from dynarl.backends.sglang._http_wire import GenerateRequest, SamplingParams
from dynarl.backends.sglang._server_launcher import SGLangServer, SGLangServerConfig, launch_command
from dynarl.errors import BackendError

FAKE = "dynarl.testing.sglang_fake"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launch_command_carries_the_flags() -> None:
    config = SGLangServerConfig(
        model_path="m",
        tp_size=2,
        admin_api_key="k",
        schedule_low_priority_values_first=True,
        extra_args=("--mem-fraction-static", "0.5"),
        python="py",
    )
    assert launch_command(config, 31000) == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tp-size",
        "2",
        "--enable-memory-saver",
        "--enable-priority-scheduling",
        "--schedule-low-priority-values-first",
        "--admin-api-key",
        "k",
        "--mem-fraction-static",
        "0.5",
    ]


def test_starts_serves_and_stops_its_process() -> None:
    config = SGLangServerConfig(
        model_path="m", module=FAKE, admin_api_key="adm", health_poll_s=0.05, startup_timeout_s=60
    )

    async def main() -> int:
        async with SGLangServer(config) as server:
            pid = server.pid
            assert pid is not None and _alive(pid)
            async with SGLangClient(server.client_config()) as client:
                result = await client.generate(
                    GenerateRequest(
                        rid="x", input_ids=[1], sampling_params=SamplingParams(max_new_tokens=2)
                    )
                )
                assert len(result.output_ids) == 2
                await client.pause("abort")  # admin endpoint: the key reached the server
        return pid

    pid = asyncio.run(main())
    assert not _alive(pid)


def test_a_server_that_exits_during_startup_is_reported() -> None:
    config = SGLangServerConfig(
        model_path="m", module="dynarl.no_such_module", health_poll_s=0.05, startup_timeout_s=60
    )

    async def main() -> None:
        with pytest.raises(BackendError, match="exited with status 1 during start-up"):
            await SGLangServer(config).start()

    asyncio.run(main())


def test_a_server_that_never_gets_healthy_is_killed(tmp_path: pathlib.Path) -> None:
    pid_file = tmp_path / "pid"
    (tmp_path / "stubborn_server.py").write_text(
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "print('loading...', flush=True)\n"
        "time.sleep(120)\n"
    )
    config = SGLangServerConfig(
        model_path="m",
        module="stubborn_server",
        env=(("PYTHONPATH", str(tmp_path)),),
        startup_timeout_s=1.0,
        health_poll_s=0.05,
        stop_timeout_s=0.5,
        python=sys.executable,
    )
    server = SGLangServer(config)

    async def main() -> None:
        with pytest.raises(BackendError, match=r"(?s)not healthy after 1.0 s.*loading"):
            await server.start()

    asyncio.run(main())
    assert server.pid is None
    assert not _alive(int(pid_file.read_text()))
