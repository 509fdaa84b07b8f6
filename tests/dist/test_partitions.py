"""Link cuts at migration phases, across hosts (markers ``dist`` and ``netns``; the full
matrix ``slow``).

Three hosts (``tests/netns_support.py``); the durable fault loop of
``tests/fault_loop.py`` with device ``d``'s worker on host ``d`` and the controller on
host 0, driven by ``tests/partition_loop.py`` inside host 0's namespace. Each case cuts
the link of one participant's host when its move reaches a phase (the ``cut`` fault, at
the :class:`~dynarl.runtime.FaultInjector` barrier), restores it once the cut worker has
left, and must end like a kill: ``old``, ``new`` or ``restore``. Then:

- the cut worker left by itself (status 1) within
  ``(num_missed_heartbeats + 1) × heartbeat_interval_s + collective_timeout_s + 2 s`` of
  the cut (the loop's settings lower them so that a case takes seconds);
- every sample was trained exactly once (no manifest violation), the journalled step
  digests and the final trainer checksum equal an uninterrupted run's;
- nothing is left running (the namespaces' teardown kills nothing: asserted empty);
- workers on every host reach their component's manager (metrics bind the bus's host).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import fault_loop
import pytest
from netns_support import (
    Network,
    ip,
    netns,  # noqa: F401 (the fixture)
)
from torchrun_support import ROOT, environment

from dynarl.bus import generate_keys
from dynarl.migrate import KIND_STEPS
from dynarl.types import MigrationKind

pytestmark = [pytest.mark.dist, pytest.mark.netns]

logger = logging.getLogger(__name__)

TESTS = Path(__file__).resolve().parent.parent
BASE = {"rollout": [0, 1], "trainer": [2]}
GROW = {"rollout": [0], "trainer": [1, 2]}  # workload + P2P or reboot
SHRINK = {"rollout": [0], "trainer": [2]}  # workload only: device 1 freed
TIMEOUT_S = 900


def case(kind: str, step: str, device: int, expected: str | None) -> dict[str, object]:
    target = SHRINK if kind == "workload" else GROW
    name = f"cut {device} at {kind} {step}"
    return {"name": name, "phase": f"{kind}.{step}", "device": device, "target": target,
            "expected": expected}  # fmt: skip


# Device 1 is the donor of a workload move and the rank a P2P/reboot trainer grows onto;
# device 2 holds the trainer's only copy of its state until the move commits.
FAST = {  # one case per migration kind; one job for the two a P2P trainer's moves reach
    "workload-p2p": (
        "p2p",
        [case("workload", "drain", 1, "old"), case("p2p", "transfer", 2, "restore")],
    ),
    "reboot": ("reboot", [case("reboot", "restart", 2, "restore")]),
}


def full(kind: MigrationKind) -> tuple[str, list[dict[str, object]]]:
    """Every forward step of ``kind`` the loop's moves reach, cutting each participant."""
    steps = [str(s) for s in KIND_STEPS[kind] if str(s) not in ("grow", "redispatch")]
    devices = [1] if kind is MigrationKind.WORKLOAD else [1, 2]
    trainer = "reboot" if kind is MigrationKind.REBOOT else "p2p"
    return trainer, [case(str(kind), s, d, None) for s in steps for d in devices]


def drive(net: Network, tmp: Path, trainer: str, cases: list[dict[str, object]]) -> dict:  # type: ignore[type-arg]
    keys = tmp / "keys"
    for name in ["controller", *(f"worker-{d}" for d in range(len(net.hosts)))]:
        generate_keys(keys, name)
    run_dir = net.hosts[0].job_dir / "run"
    setup = {
        "run_dir": str(run_dir), "namespaces": [h.namespace for h in net.hosts],
        "addresses": [h.address for h in net.hosts], "switch": net.switch,
        "ports": [h.port for h in net.hosts], "keys": str(keys), "kind": trainer,
        "cases": cases,
    }  # fmt: skip
    (tmp / "setup.json").write_text(json.dumps(setup))
    env = environment()
    log = tmp / "driver.log"
    driver = net.run(
        net.hosts[0], [sys.executable, str(TESTS / "partition_loop.py"), str(tmp / "setup.json")],
        log=log, env=net.environment(net.hosts[0], env), cwd=ROOT,
    )  # fmt: skip
    try:
        code = driver.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        net.stop(driver)
        pytest.fail(f"the driver ran past {TIMEOUT_S} s:\n{log.read_text()[-6000:]}")
    assert code == 0, log.read_text(errors="replace")[-8000:]
    for host in net.hosts:  # nothing of the job outlives it
        assert ip("netns", "pids", host.namespace).split() == [], host.namespace
    for log in (run_dir / "workers").glob("worker-*.log"):  # metrics reach the managers
        assert "no manager for" not in log.read_text(errors="replace"), log
    return dict(json.loads((run_dir / "result.json").read_text()))


def check(result: dict, cases: list[dict[str, object]]) -> None:  # type: ignore[type-arg]
    rows = result["cases"]
    assert [r["name"] for r in rows] == [c["name"] for c in cases]
    for row in rows:
        logger.warning(
            "PARTITION-TABLE | %s | %s | %s | left after %.2f s (bound %.2f) | %s",
            row["name"], row["phase"], row["outcome"], row["left_s"], result["leave_bound_s"],
            row["reason"],
        )  # fmt: skip
        assert row["outcome"] in fault_loop.OUTCOMES
        if row["expected"] is not None:
            assert row["outcome"] == row["expected"], row
        assert row["status"] == 1, row  # it left by itself: it stopped hearing the controller
        assert row["left_s"] <= result["leave_bound_s"], row
    assert result["violations"] == []
    assert result["allocation"] == BASE
    digests, checksum = fault_loop.reference(len(result["digests"]))
    assert result["digests"] == digests
    assert result["checksum"] == checksum


@pytest.mark.parametrize("kind", list(FAST))
def test_a_host_cut_off_mid_migration_ends_in_a_defined_outcome(
    netns: Callable[[int], Network],  # noqa: F811
    tmp_path: Path,
    kind: str,
) -> None:
    trainer, cases = FAST[kind]
    check(drive(netns(3), tmp_path, trainer, cases), cases)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MigrationKind))
def test_every_phase_and_participant_cut_off(
    netns: Callable[[int], Network],  # noqa: F811
    tmp_path: Path,
    kind: MigrationKind,
) -> None:
    trainer, cases = full(kind)
    check(drive(netns(3), tmp_path, trainer, cases), cases)
