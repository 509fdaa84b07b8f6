"""The fault loop across hosts: link cuts at migration phases (a driver, run in a namespace).

``python partition_loop.py SETUP.json`` runs :mod:`fault_loop`'s durable job with device
``d``'s worker on host ``d`` (network namespaces made by ``tests/netns_support.py``; the
driver itself, the controller, runs on host 0). The bus binds host 0's address with CURVE,
every worker holding a key of its own; the job's TCPStore listens there too. Each case
arms a ``cut`` :class:`~dynarl.runtime.Fault` at one migration phase: when the move
reaches it, the cut device's switch port goes down (the worker lives on, unreachable).

What a cut must lead to, and how long it may take (the bound the test checks):

- the controller stops hearing the worker and its move's step fails: the other
  participant's collective ends within ``collective_timeout_s``, a reply within
  ``request_timeout_s``;
- the cut worker stops hearing the controller and leaves (status 1) within
  ``(num_missed_heartbeats + 1) × heartbeat_interval_s + collective_timeout_s + 2 s`` of
  the cut: its missed heartbeats, one interval of tick granularity, the deadline of its
  close (behind the partition a close that touches the store would wait on TCP for
  minutes), and an allowance for a loaded host;
- then the link is restored, :meth:`DurableRun.recover` starts the worker again on its
  host and the case ends as a kill would: ``old``, ``new`` or ``restore``, with every
  sample trained exactly once.

The cases' outcomes, each worker's time to leave, the journalled digests and the final
checksum go to ``result.json`` in the run directory, for the test to compare with an
uninterrupted run (:func:`fault_loop.reference`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import fault_loop
from fault_loop import Case

from dynarl.bus import CurveServer
from dynarl.runtime import RuntimeConfig
from dynarl.runtime._faults import Fault, FaultAction
from dynarl.runtime._store import host_store
from dynarl.runtime.launch import LocalLauncher
from dynarl.runtime.worker import WorkerOptions
from dynarl.types import Allocation, MigrationKind

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

logger = logging.getLogger(__name__)

IFNAME = "dynarl0"
"""Every host's interface (``netns_support.IFNAME``): gloo's, by name."""
HEARTBEAT_S = 0.5
MISSED = 6
TIMEOUTS = {"collective_timeout_s": 4.0, "request_timeout_s": 8.0}
SCHEDULING_S = 2.0
"""Allowance for a loaded host: the worker's loop, its exit, the launcher's poll (measured
worst case with every term above spent: 0.1 s over them)."""


def runtime() -> RuntimeConfig:
    """The loop's settings with heartbeats short enough that a cut costs seconds."""
    return dataclasses.replace(
        fault_loop.runtime(), heartbeat_interval_s=HEARTBEAT_S, num_missed_heartbeats=MISSED,
        **TIMEOUTS,
    )  # fmt: skip


def leave_bound_s(config: RuntimeConfig) -> float:
    """How long after a cut the cut worker must have left: its missed heartbeats, one
    interval of tick granularity, its close's deadline, and :data:`SCHEDULING_S`."""
    misses = config.num_missed_heartbeats + 1
    return misses * config.heartbeat_interval_s + config.collective_timeout_s + SCHEDULING_S


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """What the test hands the driver (``SETUP.json``)."""

    run_dir: str
    namespaces: list[str]
    """Host ``i``'s namespace; device ``i`` runs on host ``i``."""
    addresses: list[str]
    switch: str
    """The switch's namespace."""
    ports: list[str]
    """Host ``i``'s port on the switch."""
    keys: str
    """Directory of the key pairs: ``controller`` and ``worker-<d>``."""
    kind: str
    """The trainer's migration kind (``p2p`` or ``reboot``)."""
    cases: list[dict[str, object]]
    """``{"name", "phase", "device", "target", "expected"}`` each."""


class NetnsLauncher(LocalLauncher):
    """Starts device ``d``'s worker in namespace ``d``, with CURVE keys and the store on
    host 0's address; cuts and restores a device's link (the fault injector's hook)."""

    def __init__(self, setup: Setup, *, log_dir: Path, store_timeout_s: float) -> None:
        super().__init__(log_dir=log_dir, env=dict(os.environ, GLOO_SOCKET_IFNAME=IFNAME))
        self.setup = setup
        self.address = setup.addresses[0]
        self._store_timeout_s = store_timeout_s
        self._store: Store | None = None
        self.cut_at: dict[int, float] = {}

    @property
    def store(self) -> Store | None:
        if self._store is None:
            self._store = host_store(self.address, 0, timeout_s=self._store_timeout_s)
        return self._store

    @property
    def bind(self) -> str:
        return f"tcp://{self.address}:0"

    @property
    def curve(self) -> CurveServer | None:
        keys = Path(self.setup.keys)
        clients = [keys / f"worker-{d}.key" for d in range(len(self.setup.namespaces))]
        return CurveServer.from_files(keys / "controller.key_secret", clients)

    async def start(self, workers: Sequence[WorkerOptions]) -> None:
        keys = Path(self.setup.keys)
        store = self.store
        port = int(getattr(store, "port", 0))
        await super().start([
            dataclasses.replace(
                options, store_host=self.address, store_port=port,
                key_file=str(keys / f"worker-{options.device}.key_secret"),
                server_key_file=str(keys / "controller.key"),
            )
            for options in workers
        ])  # fmt: skip

    def command(self, options: WorkerOptions) -> list[str]:
        namespace = self.setup.namespaces[options.device]
        return ["ip", "netns", "exec", namespace, *super().command(options)]

    def _port(self, device: int, state: str) -> None:
        port = self.setup.ports[device]
        subprocess.run(
            ["ip", "-n", self.setup.switch, "link", "set", port, state], check=True, timeout=30
        )

    def cut(self, device: int) -> None:
        """Take device ``device``'s host off the network."""
        logger.warning("cutting the link of device %d's host", device)
        self._port(device, "down")
        self.cut_at[device] = time.monotonic()

    def restore(self, device: int) -> None:
        self._port(device, "up")
        logger.warning("restored the link of device %d's host", device)


def case_of(entry: Mapping[str, object]) -> Case:
    device = int(str(entry["device"]))
    target = Allocation.of(entry["target"])  # type: ignore[arg-type]
    fault = Fault(phase=str(entry["phase"]), action=FaultAction.CUT, device=device)
    expected = entry.get("expected")
    return Case(name=str(entry["name"]), fault=fault, target=target,
                expected=None if expected is None else str(expected))  # fmt: skip


async def drive(setup: Setup) -> dict[str, object]:
    run_dir = Path(setup.run_dir)
    config = runtime()
    launcher = NetnsLauncher(
        setup, log_dir=run_dir / "workers", store_timeout_s=config.collective_timeout_s
    )
    cases = [case_of(entry) for entry in setup.cases]
    rows: list[dict[str, object]] = []

    async def heal(case: Case) -> None:
        """Wait for the cut worker to leave (it stops hearing the controller), then
        restore its link."""
        device = case.fault.device
        assert device is not None
        status = await launcher.wait(device, within_s=4 * leave_bound_s(config) + 30.0)
        left_s = time.monotonic() - launcher.cut_at[device]
        launcher.restore(device)
        rows.append({"name": case.name, "phase": case.fault.phase, "left_s": left_s,
                     "status": status})  # fmt: skip

    trainer = MigrationKind(setup.kind)
    job = fault_loop.job(run_dir, trainer=trainer, config=config, launcher=launcher)
    async with asyncio.timeout(900), job:
        job.faults.cut = launcher.cut
        run = await fault_loop.durable(job).open()
        await fault_loop.step(job, run)
        for case in cases:
            result, reason = await fault_loop.run_case(job, run, case, after=heal)
            rows[-1].update(outcome=result, expected=case.expected, reason=reason)
        while run.step < len(cases) + 2:
            await fault_loop.step(job, run)
        report = run.report()
        final = await fault_loop.checksum(job)
        allocation = job.allocation.as_dict()
    return {
        "cases": rows, "leave_bound_s": leave_bound_s(config),
        "digests": fault_loop.journal_digests(run_dir), "checksum": final,
        "violations": [v.kind for v in report.violations], "allocation": allocation,
    }  # fmt: skip


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    setup = Setup(**json.loads(Path(sys.argv[1]).read_text()))
    result = asyncio.run(drive(setup))
    (Path(setup.run_dir) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
