"""Several "hosts" on this machine: network namespaces on a private network (tests only).

:func:`network` makes ``num_hosts`` namespaces, ``dynarl-<run id>-h<i>``, each with ``lo``
up and one veth interface (:data:`IFNAME`) at ``10.213.0.<i + 1>/24``, and no default
route: a host reaches the others and nothing else. The hosts' veth peers are ports of a
bridge that lives in a namespace of its own (``dynarl-<run id>-sw``), so every link dies
with the namespaces and nothing is created in this machine's own network namespace (two
runs may use the same addresses: their switches are separate). Each host gets its own job
directory (``<tmp>/h<i>``); the namespaces share this machine's filesystem, which the tests
do not rely on but for the job's modules and its warm-start cache.

The run id is ``<pid>-<token>``: :func:`sweep`, called before a network is made, deletes
every ``dynarl-<pid>-*`` namespace whose process is gone (a run killed before its
teardown), with the processes left inside it. Teardown kills what :meth:`Network.run`
started (by process group, its leader's pid), then every process still in a namespace,
then deletes the namespaces — also when the test failed.

Traps a multi-host job meets here: the hostname resolves to 127.0.0.1 in every namespace,
so gloo must be told its interface (``GLOO_SOCKET_IFNAME``, in :meth:`Network.environment`)
and torchrun each node's address (``--local-addr``: the MASTER_ADDR the ranks get).
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PREFIX = "dynarl"
"""First part of every namespace's name."""
SUBNET = "10.213.0"
"""The hosts' /24 (host ``i`` is ``.i + 1``): private, with no route anywhere else."""
IFNAME = "dynarl0"
"""The veth interface inside every host's namespace (for ``GLOO_SOCKET_IFNAME``)."""
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-(h\d+|sw)$")
_IP_TIMEOUT_S = 30


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return None


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; its output. Raises CalledProcessError (with stderr) when it fails
    and ``check``."""
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, check=False, timeout=_IP_TIMEOUT_S
    )
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(
            done.returncode, ["ip", *args], done.stdout, done.stderr
        )
    return done.stdout


def namespaces() -> list[str]:
    """Names of every network namespace on this machine."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(namespace: str) -> None:
    """SIGKILL every process still in ``namespace`` (ones this module's runs started)."""
    for line in ip("netns", "pids", namespace, check=False).split():
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(line), signal.SIGKILL)


def _delete(namespace: str) -> None:
    _kill_inside(namespace)
    ip("netns", "delete", namespace, check=False)


def sweep() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone (with the processes
    left inside them); the names deleted."""
    stale = [
        name
        for name in namespaces()
        if (match := _NAME.match(name)) and not _alive(int(match.group(1)))
    ]
    for name in stale:
        _delete(name)
    return stale


@dataclass(frozen=True, slots=True)
class Host:
    """One namespace on the network."""

    index: int
    """Position on the network (``h<index>``)."""
    namespace: str
    """The network namespace's name."""
    address: str
    """Its address on the network (``10.213.0.<index + 1>``)."""
    port: str
    """Its port on the switch (what :meth:`Network.cut` takes down)."""
    job_dir: Path
    """A directory of its own."""


@dataclass(slots=True)
class Network:
    """Hosts on one switch, and the processes started in them."""

    run_id: str
    """``<pid>-<token>``: what every name made for this network carries."""
    hosts: tuple[Host, ...]
    """The hosts, by index."""
    switch: str
    """The namespace of the bridge that joins the hosts."""
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """What :meth:`run` started, in order (each leads its own process group)."""

    def environment(self, host: Host, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with gloo bound to the host's
        interface (the hostname resolves to 127.0.0.1 in every namespace)."""
        return dict(os.environ if base is None else base, GLOO_SOCKET_IFNAME=IFNAME)

    def run(
        self,
        host: Host,
        command: Sequence[str],
        *,
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``command`` in ``host``'s namespace (``ip netns exec``: the returned
        process is the command itself) in a session of its own, output to ``log``;
        ``env`` default: :meth:`environment`. Stopped at teardown unless :meth:`stop`
        stopped it first."""
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, *command],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                env=dict(env) if env is not None else self.environment(host),
            )  # fmt: skip
        self.processes.append(process)
        return process

    def stop(self, process: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to ``process``'s group (by its pid); its exit status."""
        if process.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        return process.wait(timeout=30)

    def cut(self, host: Host) -> None:
        """Take ``host``'s switch port down: the host keeps its address and loses carrier;
        nothing it sends arrives, nothing reaches it."""
        ip("-n", self.switch, "link", "set", host.port, "down")

    def restore(self, host: Host) -> None:
        """Bring ``host``'s switch port back up."""
        ip("-n", self.switch, "link", "set", host.port, "up")

    def close(self) -> None:
        """Kill every process started here that still runs (by group), then whatever is
        still inside a namespace, then delete the namespaces. Idempotent."""
        for process in self.processes:
            if process.poll() is None:  # a reaped leader's pid may belong to another by now
                with suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            with suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        for name in [host.namespace for host in self.hosts] + [self.switch]:
            _delete(name)


def _add_host(net: Network, index: int, job_dir: Path) -> Host:
    name = f"{PREFIX}-{net.run_id}-h{index}"
    host = Host(index, name, f"{SUBNET}.{index + 1}", f"p{index}", job_dir)
    ip("netns", "add", name)
    net.hosts += (host,)  # recorded before anything can fail: teardown deletes it
    ip("-n", name, "link", "set", "lo", "up")
    # Both ends made in their namespaces: nothing ever appears in this machine's own.
    ip("link", "add", IFNAME, "netns", name, "type", "veth",
       "peer", "name", host.port, "netns", net.switch)  # fmt: skip
    ip("-n", net.switch, "link", "set", host.port, "master", "br0")
    ip("-n", net.switch, "link", "set", host.port, "up")
    ip("-n", name, "addr", "add", f"{host.address}/24", "dev", IFNAME)
    ip("-n", name, "link", "set", IFNAME, "up")
    job_dir.mkdir(parents=True, exist_ok=True)
    return host


@contextmanager
def network(num_hosts: int, tmp: Path) -> Iterator[Network]:
    """``num_hosts`` hosts on one switch, job directories under ``tmp``; everything made
    is removed on exit, whatever happened. Sweeps stale runs first. Raises
    CalledProcessError when ``ip`` refuses a step (what was made is removed)."""
    if not 1 <= num_hosts <= 200:
        raise ValueError(f"num_hosts must be in [1, 200], got {num_hosts}")
    sweep()
    run_id = f"{os.getpid()}-{secrets.token_hex(3)}"
    net = Network(run_id=run_id, hosts=(), switch=f"{PREFIX}-{run_id}-sw")
    try:
        ip("netns", "add", net.switch)
        ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", net.switch, "link", "set", "br0", "up")
        for index in range(num_hosts):
            _add_host(net, index, tmp / f"h{index}")
        yield net
    finally:
        net.close()


@pytest.fixture
def netns(tmp_path: Path) -> Iterator[Callable[[int], Network]]:
    """``netns(n)``: a :func:`network` of ``n`` hosts under ``tmp_path``, removed at the
    end of the test. Skips the test where namespaces cannot be made (not root, no
    ``ip netns``). Import it into the test module to use it."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    made = itertools.count()
    with ExitStack() as stack:

        def make(num_hosts: int) -> Network:
            return stack.enter_context(network(num_hosts, tmp_path / f"net{next(made)}"))

        yield make
