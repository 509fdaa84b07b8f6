"""``make chaos``: the durable job across three hosts under seeded faults, for a while.

``python tests/chaos.py --seconds S --seed N`` (root: it makes network namespaces) builds
three hosts (``tests/netns_support.py``) and runs ``tests/chaos_loop.py`` in host 0's
namespace until ``S`` seconds have passed; a driver killed by its own controller-kill fault
is started again (once its orphaned workers have left) and resumes from the journal and the
last checkpoint. At the end it checks the invariants over the whole run — the journalled
step digests and the trainer's checksum equal an uninterrupted run's (computed in this
process by :func:`fault_loop.reference` for the test seams; for the reference job,
``--stack reference``, the default, by running the loop as long without a fault or a
move), no sample lost or duplicated, no manifest violation, nothing left running — and
prints the faults by kind, the outcomes, recovery times, each process's RSS and fd count
at start and end, then one JSON line with ``faults``, ``samples_lost``,
``samples_duplicated``, ``recovery_s_max`` and the rest. Exit status 1 when an invariant
fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS), str(TESTS.parent / "examples")]

import fault_loop  # noqa: E402
from netns_support import Network, ip, network, unavailable  # noqa: E402
from torchrun_support import ROOT, environment  # noqa: E402

from dynarl.bus import generate_keys  # noqa: E402

MAX_RESTARTS = 50
ORPHANS_S = 60.0
"""How long orphaned workers of a killed controller may take to leave (they need their
missed heartbeats and their close's deadline: seconds)."""
SLACK_S = 600.0
"""How long past ``--seconds`` a driver may run (the last step, the restarts)."""


def _empty(net: Network, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(ip("netns", "pids", h.namespace).split() for h in net.hosts):
            return True
        time.sleep(0.2)
    return False


def _setup(net: Network, tmp: Path, seconds: float, seed: int, stack: fault_loop.Stack) -> Path:
    keys = tmp / "keys"
    for name in ["controller", *(f"worker-{d}" for d in range(len(net.hosts)))]:
        generate_keys(keys, name)
    hosts = {
        "run_dir": str(net.hosts[0].job_dir / "run"),
        "namespaces": [h.namespace for h in net.hosts],
        "addresses": [h.address for h in net.hosts], "switch": net.switch,
        "ports": [h.port for h in net.hosts], "keys": str(keys), "kind": "p2p", "cases": [],
    }  # fmt: skip
    path = tmp / "chaos-setup.json"
    deadline = time.time() + seconds
    setup = {"hosts": hosts, "seed": seed, "deadline": deadline, "stack": stack.to_json()}
    path.write_text(json.dumps(setup))
    return path


def run_chaos(
    seconds: float, seed: int, tmp: Path, stack: fault_loop.Stack = fault_loop.TINY
) -> dict[str, Any]:
    """Run the chaos job for ``seconds`` on a fresh network under ``tmp``; the summary.
    The uninterrupted run of any ``stack`` but the tiny one is run after the chaos (one
    host, no fault, no move) rather than computed here. Raises RuntimeError when a driver
    fails other than by its controller-kill fault."""
    with network(3, tmp) as net:
        setup = _setup(net, tmp, seconds, seed, stack)
        run_dir = net.hosts[0].job_dir / "run"
        restarts = 0
        env = net.environment(net.hosts[0], environment())
        command = [sys.executable, str(TESTS / "chaos_loop.py"), str(setup)]
        while True:
            log = tmp / f"driver-{restarts}.log"
            driver = net.run(net.hosts[0], command, log=log, env=env, cwd=ROOT)
            code = driver.wait(timeout=seconds + SLACK_S)
            if code == 0:
                break
            text = log.read_text(errors="replace")[-6000:]
            if code != -signal.SIGKILL or restarts >= MAX_RESTARTS:
                raise RuntimeError(f"the chaos driver exited with {code}:\n{text}")
            if not _empty(net, ORPHANS_S):
                raise RuntimeError(f"workers outlived their controller by {ORPHANS_S} s")
            restarts += 1
        left = [p for h in net.hosts for p in ip("netns", "pids", h.namespace).split()]
        lines = (run_dir / "chaos-events.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines]
        result = json.loads((run_dir / "result.json").read_text())
    steps = len(result["digests"])
    if stack == fault_loop.TINY:
        clean = fault_loop.reference(steps)
    else:
        clean = asyncio.run(fault_loop.clean_run(tmp / "clean", steps, stack))
    return summarise(events, result, clean, restarts=restarts, left_running=len(left))


def summarise(
    events: list[dict[str, Any]],
    result: dict[str, Any],
    uninterrupted: tuple[list[str], str],
    *,
    restarts: int,
    left_running: int,
) -> dict[str, Any]:
    """The run's figures from its event records, its final result and the
    ``uninterrupted`` run's (step digests, checksum)."""
    steps = [e for e in events if e["kind"] == "step"]
    fired = [e for e in steps if e["action"] is not None]
    # A controller kill is recorded before it is armed; it fired when a restart follows.
    kills = [
        (e, after)
        for e, after in itertools.pairwise(events)
        if e["kind"] == "fault" and after["kind"] == "open"
    ]
    faults = Counter(e["action"] for e in fired) + Counter(e["action"] for e, _ in kills)
    outcomes = Counter(e["outcome"] for e in fired) + Counter({"restart": len(kills)})
    recovery = [float(e["recovery_s"]) for e in fired]
    recovery += [float(opened["time"]) - float(kill["time"]) for kill, opened in kills]
    digests, checksum = uninterrupted
    opens = [e for e in events if e["kind"] == "open"]
    return {
        "faults": sum(faults.values()), "faults_by_kind": dict(faults),
        "outcomes": dict(outcomes), "steps": len(result["digests"]),
        "controller_restarts": restarts,
        "samples_lost": len(result["lost"]), "samples_duplicated": len(result["duplicated"]),
        "violations": len(result["violations"]),
        "digests_equal": result["digests"] == digests,
        "checksum_equal": result["checksum"] == checksum,
        "recovery_s_median": statistics.median(recovery) if recovery else 0.0,
        "recovery_s_max": max(recovery, default=0.0),
        "resources_start": opens[0]["resources"] if opens else {},
        "resources_end": next(e for e in reversed(events) if e["kind"] == "end")["resources"],
        "left_running": left_running,
    }  # fmt: skip


def ok(summary: dict[str, Any]) -> bool:
    """Whether every invariant held."""
    return (
        summary["samples_lost"] == 0 and summary["samples_duplicated"] == 0
        and summary["violations"] == 0 and summary["digests_equal"]
        and summary["checksum_equal"] and summary["left_running"] == 0
    )  # fmt: skip


def report(summary: dict[str, Any]) -> str:
    """The summary as text, its last line the JSON."""
    lines = [
        f"steps: {summary['steps']}, controller restarts: {summary['controller_restarts']}",
        f"faults by kind: {summary['faults_by_kind']}",
        f"outcomes: {summary['outcomes']}",
        f"samples lost: {summary['samples_lost']}, duplicated: {summary['samples_duplicated']}, "
        f"manifest violations: {summary['violations']}",
        f"digests equal an uninterrupted run's: {summary['digests_equal']}, "
        f"checksum equal: {summary['checksum_equal']}",
        f"recovery (s): median {summary['recovery_s_median']:.2f}, "
        f"max {summary['recovery_s_max']:.2f}",
        "process   RSS start → end (MB)   fds start → end",
    ]
    start, end = summary["resources_start"], summary["resources_end"]
    for name in sorted(set(start) | set(end)):
        a, b = start.get(name, {}), end.get(name, {})
        lines.append(
            f"{name:<10}{a.get('rss', 0) / 1e6:8.1f} → {b.get('rss', 0) / 1e6:8.1f}"
            f"{a.get('fds', 0):10d} → {b.get('fds', 0)}"
        )
    lines.append(json.dumps(summary, sort_keys=True))
    return "\n".join(lines)


def stack_of(name: str) -> fault_loop.Stack:
    """The stack named ``name``; the reference one with the reference job's initial weights
    (``examples/torchrun_job.py``'s, warm-started once and cached by configuration), every
    group and micro-batch of its trainer as the loop needs them."""
    if name != "reference":
        return fault_loop.Stack(name=name)
    import torchrun_job

    from dynarl.backends.reference import default_train

    setup = torchrun_job.prepared(torchrun_job.parse([]))
    train = default_train(group_timeout_s=fault_loop.MEGATRON.train.group_timeout_s)
    return fault_loop.Stack(name=name, setup=dataclasses.replace(setup, train=train))


def main() -> int:
    parser = argparse.ArgumentParser(prog="tests/chaos.py", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="run length (default 600)")
    parser.add_argument("--seed", type=int, default=1, help="the fault plan's seed")
    parser.add_argument("--dir", type=Path, help="keep the run here (default: a temporary one)")
    parser.add_argument(
        "--stack", choices=("reference", "megatron", "tiny"), default="reference",
        help="the reference job's engine and trainer (default); the scripted rollout with "
        "the production trainer; or the test seams (scripted rollout, tiny trainer)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.seconds <= 0:
        parser.error(f"--seconds must be positive, got {args.seconds}")
    reason = unavailable()
    if reason is not None:
        sys.stderr.write(f"chaos needs network namespaces: {reason}\n")
        return 2
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=False)
        summary = run_chaos(args.seconds, args.seed, args.dir, stack_of(args.stack))
    else:
        with tempfile.TemporaryDirectory(prefix="dynarl-chaos-") as tmp:
            summary = run_chaos(args.seconds, args.seed, Path(tmp), stack_of(args.stack))
    sys.stdout.write(report(summary) + "\n")
    return 0 if ok(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
