"""Devices as cores: the pinning map, the workers' ``--cpus`` flag, servers started on given
cores, and busy time read from ``/proc``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynarl.backends._server_process import ServerProcess
from dynarl.backends.serving import EngineSetup
from dynarl.backends.vllm import VLLMServerConfig
from dynarl.backends.vllm._launcher import server_env
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.runtime._cores import (
    CoreClock,
    CoreUsage,
    LoadMeter,
    pinned_cores,
    process_cpu_seconds,
    read_core_times,
    tree_cpu_seconds,
)
from dynarl.runtime.launch._torchrun import parse_args
from dynarl.runtime.worker import WorkerOptions
from dynarl.testing import TinyTrainer


@given(
    available=st.sets(st.integers(0, 255), min_size=1, max_size=64),
    num_devices=st.integers(0, 70),
)
def test_each_device_gets_its_own_core_in_order_or_the_job_is_refused(
    available: set[int], num_devices: int
) -> None:
    if num_devices > len(available):
        with pytest.raises(ValueError, match=f"the job has {num_devices} devices but"):
            pinned_cores(num_devices, available)
        return
    cores = pinned_cores(num_devices, available)
    assert list(cores) == list(range(num_devices))
    assert len(set(cores.values())) == num_devices and set(cores.values()) <= available
    assert list(cores.values()) == sorted(cores.values())


def test_a_refusal_names_the_cores_it_could_use() -> None:
    with pytest.raises(ValueError, match=r"may run on 5 cores \(0-3,6\)"):
        pinned_cores(6, [6, 0, 1, 2, 3])


def test_a_pinned_job_with_more_devices_than_cores_is_refused_at_construction() -> None:
    too_many = len(os.sched_getaffinity(0)) + 1
    spec = ComponentSpec(role=TinyTrainer, devices=tuple(range(too_many)))
    with pytest.raises(ValueError, match=r"RuntimeConfig\.pin_cores: the job has"):
        Job([spec], JobConfig(runtime=RuntimeConfig(pin_cores=True)))


def test_workers_carry_their_cores_on_the_command_line() -> None:
    options = WorkerOptions(controller="tcp://127.0.0.1:5", device=1, cpus=(3, 1))
    assert "--cpus=3,1" in options.to_args()
    assert WorkerOptions.from_args(options.to_args()) == options
    assert WorkerOptions.from_args(["--controller=x", "--device=0"]).cpus == ()
    with pytest.raises(ValueError, match="--cpus must be core ids"):
        WorkerOptions.from_args(["--controller=x", "--device=0", "--cpus=0,a"])
    with pytest.raises(ValueError, match="distinct core ids"):
        WorkerOptions(controller="x", device=0, cpus=(1, 1))


def test_workers_carry_their_curve_keys_on_the_command_line() -> None:
    keyed = WorkerOptions(controller="x", device=2, key_file="w.sec", server_key_file="c.key")
    assert WorkerOptions.from_args(keyed.to_args()) == keyed
    assert "--key-file=w.sec" in keyed.to_args()
    plain = WorkerOptions(controller="x", device=2)
    assert not any(arg.startswith("--key-file") for arg in plain.to_args())
    with pytest.raises(ValueError, match="key_file and server_key_file go together"):
        WorkerOptions(controller="x", device=0, key_file="w.key_secret")


_STAT = """cpu  100 0 50 900 10 0 0 0 0 0
cpu0 60 0 20 400 5 0 0 0 0 0
cpu1 40 5 30 500 5 1 2 3 0 0
intr 123
"""


def test_core_times_count_user_nice_system_irq_softirq_steal() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    assert read_core_times(_STAT) == {0: 80 / tick, 1: 81 / tick}
    live = read_core_times()
    assert set(live) >= set(os.sched_getaffinity(0)) and all(t >= 0 for t in live.values())


def test_core_usage_is_what_passed_since_the_clock_started() -> None:
    clock = CoreClock({0: 1})
    busy_until = sum(range(3_000_000))  # some work, so some core is busy
    usage = clock.usage()
    assert busy_until > 0 and usage.wall_s > 0 and usage.devices == {0: 1}
    assert all(0 <= b for b in usage.busy_s.values()) and sum(usage.busy_s.values()) > 0
    as_json = CoreUsage(wall_s=2.0, busy_s={0: 1.0, 1: 0.0}, devices={0: 0}).to_json()
    assert as_json == {
        "wall_s": 2.0,
        "cores": {
            "0": {"busy_s": 1.0, "busy_fraction": 0.5},
            "1": {"busy_s": 0.0, "busy_fraction": 0.0},
        },
        "pinned": {"0": 0},
    }


def test_a_server_started_on_a_core_runs_there_and_so_do_its_children(tmp_path: Path) -> None:
    core = max(os.sched_getaffinity(0))
    script = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "open(sys.argv[1], 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    marker = tmp_path / "child"

    async def main() -> tuple[set[int], set[int]]:
        server = ServerProcess("Stub", log_path=str(tmp_path / "log"))
        await server.start([sys.executable, "-c", script, str(marker)], cpus=(core,))
        try:
            for _ in range(3000):
                if marker.exists() and marker.read_text():
                    break
                await asyncio.sleep(0.01)
            assert server.pid is not None
            child = int(marker.read_text())
            return os.sched_getaffinity(server.pid), os.sched_getaffinity(child)
        finally:
            await server.aclose()

    assert asyncio.run(main()) == ({core}, {core})


def test_cpu_seconds_of_processes_come_from_proc() -> None:
    mine = process_cpu_seconds([os.getpid()])
    times = os.times()
    assert mine == pytest.approx(times.user + times.system, abs=0.05)
    assert process_cpu_seconds([2**22 + 7]) == 0.0  # no such process: nothing


BURN = "import time\nwhile time.process_time() < {seconds}: pass\n"
"""A process that spends ``seconds`` of CPU, then exits (whatever the machine's load)."""


def test_a_reaped_childs_cpu_stays_in_the_tree_and_a_strangers_is_foreign(
    tmp_path: Path,
) -> None:
    meter = LoadMeter()
    before = tree_cpu_seconds()
    subprocess.run([sys.executable, "-c", BURN.format(seconds=0.4)], check=True, timeout=60)
    assert tree_cpu_seconds() - before >= 0.35  # reaped: counted through our cutime (in ticks)
    # A stranger: started by a shell that exits at once, so it is nobody's child of ours.
    pid_file = tmp_path / "pid"
    stranger = f"{sys.executable} -c '{BURN.format(seconds=0.6)}' & echo $! > {pid_file}"
    subprocess.run(["sh", "-c", stranger], check=True, timeout=60)
    pid = int(pid_file.read_text())
    for _ in range(600):  # bounded: it ends once it has spent its 0.6 s
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.05)
    load = meter.read()
    assert load.own_s >= 0.35 and load.foreign_s >= 0.5, load


def test_an_engine_on_given_cores_binds_its_threads_there() -> None:
    config = VLLMServerConfig(model="m", cpus=(2, 3))
    env = server_env(config)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3" and env["OMP_NUM_THREADS"] == "2"
    told = VLLMServerConfig(model="m", cpus=(2,), cpu_omp_threads_bind="nobind", omp_num_threads=4)
    assert server_env(told)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert server_env(told)["OMP_NUM_THREADS"] == "4"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(VLLMServerConfig(model="m"))
    vllm = EngineSetup(model="m").build(1, cpus=(5,))
    assert vllm.server is not None and vllm.server.config.cpus == (5,)  # type: ignore[attr-defined]
    sglang = EngineSetup(kind="sglang", model="m").build(1, cpus=(5,))
    server = sglang.server  # type: ignore[attr-defined]
    assert server.config.cpus == (5,)
    assert dict(server.config.env)["SGLANG_CPU_OMP_THREADS_BIND"] == "5"
    assert dict(server.config.env)["OMP_NUM_THREADS"] == "1"


def test_under_torchrun_a_worker_pins_itself_to_its_local_rank_core() -> None:
    cores = sorted(os.sched_getaffinity(0))
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    base = ["--controller=tcp://h:1", "--pin-cores"]
    if len(cores) < 2:
        with pytest.raises(ValueError, match="this node has 2 devices but"):
            WorkerOptions.from_args(base, env)
        return
    assert WorkerOptions.from_args(base, env).cpus == (cores[1],)
    assert WorkerOptions.from_args(base[:1], {**env, "DYNARL_PIN_CORES": "1"}).cpus == (cores[1],)
    assert WorkerOptions.from_args([*base, "--cpus=0"], env).cpus == (0,)  # told: as told
    assert WorkerOptions.from_args(base[:1], env).cpus == ()
    too_many = {**env, "LOCAL_WORLD_SIZE": str(len(cores) + 1)}
    with pytest.raises(ValueError, match=r"--pin-cores: this node has \d+ devices but"):
        WorkerOptions.from_args(base, too_many)


def test_the_torchrun_launcher_takes_pin_cores() -> None:
    config = parse_args(["--job", "m:j", "--job-dir", "/tmp/x", "--pin-cores", "--", "--a"])
    assert config.pin_cores and config.args == ("--a",)
    assert not parse_args(["--job", "m:j", "--job-dir", "/tmp/x"]).pin_cores
