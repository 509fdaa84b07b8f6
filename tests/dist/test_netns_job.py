"""The torchrun-launched job across hosts: ``examples/torchrun_job.py`` (the reference
rollout engine and trainer, two GRPO steps, ``--grow``) with each torchrun node in a
network namespace of its own (``tests/netns_support.py``), on the namespaces' addresses,
the bus over CURVE, each node with its own job directory.

Its manifests, rewards and trainer checksums equal those of the same job file on the local
launcher (one host). While it runs, a process in a third namespace connects to the
controller's bus with a key pair that is not on the allow-list, and is refused (the
handshake fails, the controller logs the key); one without CURVE is refused too.

What the hosts need beyond the launch of ``tests/torchrun_support.py``: torchrun's
``--local-addr`` (the hostname resolves to 127.0.0.1 in every namespace: without it the
ranks' MASTER_ADDR would point each node at itself), ``GLOO_SOCKET_IFNAME`` (gloo's
interface, for the same reason), and ``--bind-host 0.0.0.0`` (the bus then advertises
MASTER_ADDR: rank 0's node address).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from netns_support import (
    Host,
    Network,
    netns,  # noqa: F401 (the fixture)
)
from torchrun_support import (
    EXAMPLES,
    ROOT,
    TIMEOUT_S,
    committed_reshards,
    environment,
    finish,
    start,
)

from dynarl.bus import generate_keys

pytestmark = [pytest.mark.dist, pytest.mark.netns]

JOB_ARGS = ["--steps", "2", "--prompts", "3", "--group-size", "4", "--grow"]
"""The torchrun job test's job; its warm start is cached where ``torchrun_job.py`` keeps it
by default (shared with ``examples/torchrun_two_node.sh``)."""
RDZV_PORT = 29400
_ANNOUNCED = re.compile(r"controller at (tcp://[0-9.]+:\d+) admits workers")

INTRUDER = """
import json, sys
import zmq
from zmq.utils.monitor import recv_monitor_message
from dynarl.bus import load_public_key

address, server_key_file = sys.argv[1:3]
outcomes = {}
context = zmq.Context()
for case in ("unlisted_key", "no_curve"):
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    if case == "unlisted_key":  # a key pair of its own: not on the allow-list
        public, secret = zmq.curve_keypair()
        socket.curve_publickey, socket.curve_secretkey = public, secret
        socket.curve_serverkey = load_public_key(server_key_file)
        outcomes["public_key"] = public.decode()
    monitor = socket.get_monitor_socket()
    socket.connect(address)
    outcome = "no answer"
    while monitor.poll(20_000):
        event = zmq.Event(recv_monitor_message(monitor)["event"]).name
        if event.startswith("HANDSHAKE"):
            outcome = event
            break
    outcomes[case] = outcome
    socket.disable_monitor()
    monitor.close()
    socket.close()
context.term()
print(json.dumps(outcomes), flush=True)
"""


def make_keys(tmp: Path, nodes: list[str]) -> Path:
    """A key pair per node under ``tmp/keys``; their public halves in ``tmp/authorized``
    (the allow-list)."""
    authorized = tmp / "authorized"
    authorized.mkdir(parents=True)
    for node in nodes:
        public, _ = generate_keys(tmp / "keys", node)
        (authorized / public.name).write_bytes(public.read_bytes())
    return authorized


def node(
    net: Network, host: Host, rendezvous: Host, tmp: Path, authorized: Path
) -> subprocess.Popen[bytes]:
    """One torchrun node in ``host``'s namespace (the c10d rendezvous on ``rendezvous``)."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rendezvous.address}:{RDZV_PORT}",
        "--rdzv-id", "dynarl-netns-test", "--rdzv-conf", f"is_host={int(host == rendezvous)}",
        "--local-addr", host.address, "--monitor-interval", "0.5",
        "-m", "dynarl.runtime.launch", "--job", "torchrun_job:job",
        "--job-dir", str(host.job_dir), "--bind-host", "0.0.0.0",
        "--key-file", str(tmp / "keys" / f"{host.namespace}.key_secret"),
        "--allowed-keys", str(authorized), "--rendezvous-timeout", "120", "--", *JOB_ARGS,
    ]  # fmt: skip
    return net.run(
        host,
        command,
        log=tmp / f"h{host.index}.log",
        env=net.environment(host, environment()),
        cwd=ROOT,
    )


def announced(logs: list[Path], processes: list[subprocess.Popen[bytes]]) -> tuple[int, str]:
    """(index of the log, bus address) of the controller's announcement, once it is made.
    Fails when a node exits first or the time runs out."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for index, log in enumerate(logs):
            match = _ANNOUNCED.search(log.read_text(errors="replace"))
            if match:
                return index, match.group(1)
        if any(p.poll() is not None for p in processes):
            break
        time.sleep(0.1)
    text = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
    pytest.fail(f"no controller announced its bus address:\n{text}")


def local_run(tmp: Path) -> list[dict[str, object]]:
    """The job file on the local launcher (one host): its per-step records."""
    log = tmp / "local.log"
    command = [
        sys.executable,
        str(EXAMPLES / "torchrun_job.py"),
        *JOB_ARGS,
        "--run-dir",
        str(tmp / "local"),
    ]
    assert finish([start(command, log)]) == [0], log.read_text(errors="replace")[-6000:]
    return list(json.loads((tmp / "local" / "result.json").read_text())["steps"])


def test_the_job_across_hosts_trains_as_on_one_and_refuses_an_unlisted_key(
    netns: Callable[[int], Network],  # noqa: F811
    tmp_path: Path,
) -> None:
    local_steps = local_run(tmp_path)  # first: it fills the warm-start cache if empty
    net = netns(3)
    hosts, outsider = net.hosts[:2], net.hosts[2]
    authorized = make_keys(tmp_path, [h.namespace for h in hosts])
    nodes = [node(net, h, hosts[0], tmp_path, authorized) for h in hosts]
    logs = [tmp_path / f"h{h.index}.log" for h in hosts]

    # A stranger on the network, while the job runs: refused by the controller's bus.
    controller, address = announced(logs, nodes)
    server_key = tmp_path / "keys" / f"{hosts[controller].namespace}.key"
    intruder = net.run(
        outsider, [sys.executable, "-c", INTRUDER, address, str(server_key)],
        log=tmp_path / "intruder.log", env=net.environment(outsider, environment()), cwd=ROOT,
    )  # fmt: skip
    codes = finish([*nodes, intruder])
    text = "\n".join(log.read_text(errors="replace") for log in logs)
    assert codes == [0, 0, 0], text[-6000:] + (tmp_path / "intruder.log").read_text()

    refused = json.loads((tmp_path / "intruder.log").read_text().strip().splitlines()[-1])
    assert refused["unlisted_key"] == "HANDSHAKE_FAILED_AUTH"
    assert refused["no_curve"].startswith("HANDSHAKE_FAILED")
    key = refused["public_key"].encode()
    assert f"refused a CURVE client whose public key is not allowed: {key!r}" in text
    assert address.startswith(f"tcp://{hosts[controller].address}:")  # MASTER_ADDR, routable

    # Rank 0 wrote the results into its own job directory; the other host's stayed empty.
    job_dir = hosts[controller].job_dir
    assert [p.name for p in hosts[1 - controller].job_dir.iterdir()] == []
    launched = list(json.loads((job_dir / "result.json").read_text())["steps"])
    assert len(launched) == len(local_steps) == 2
    for here, there in zip(local_steps, launched, strict=True):
        assert here["manifest"] == there["manifest"]
        assert here["rewards"] == there["rewards"]
        assert here["checksum"] == there["checksum"]
        assert there["learned_on"] == [0, 1]  # the trainer grew across the hosts
    assert launched[0]["checksum"] != launched[1]["checksum"]
    # The trainer's reshards between the hosts, grow and shrink each step.
    assert committed_reshards(job_dir) == [([1], [0, 1]), ([0, 1], [1])] * 2
