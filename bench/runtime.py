"""Migration pauses of the runtime on this machine, per kind, between real processes.

One job (four worker processes): a scripted rollout engine on devices 0 and 1 with
generations in flight, a TinyTrainer (P2P) on device 2 and a second one moved by reboot on
device 3, both larger than the test's (``--hidden``). Each round moves a device from the
rollout to the trainer (workload + P2P grow), back (P2P shrink + rollout grow), then the
reboot trainer onto two devices and back. Reports the pause of every migration (the time
its component could not make progress: abort to re-dispatch for a workload migration,
prepare to commit for P2P, save to load for reboot) and the bytes a P2P move sent.

Run: ``.venv/bin/python bench/runtime.py [--rounds 3] [--hidden 256]``; the last line is
JSON with the median pause per kind in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from collections import defaultdict

from dynarl.bus import GenerationRequest, pack_tokens
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import SchedulerConfig
from dynarl.testing import ScriptedRollout, ShadowTrainer, TinyTrainer
from dynarl.types import MigrationKind


async def measure(rounds: int, hidden: int) -> dict[str, list[tuple[float, int]]]:
    options = {"hidden": hidden, "num_layers": 4}
    specs = [
        ComponentSpec(role=ScriptedRollout, devices=(0, 1), options={"tokens_per_s": 100.0}),
        ComponentSpec(role=TinyTrainer, devices=(2,), options=options),
        ComponentSpec(
            role=ShadowTrainer, devices=(3,), options=options, migration=MigrationKind.REBOOT
        ),
    ]
    config = JobConfig(
        run_dir=tempfile.mkdtemp(prefix="dynarl-bench-runtime-"),
        runtime=RuntimeConfig(scheduler=SchedulerConfig(observe_only=True)),
    )
    pauses: dict[str, list[tuple[float, int]]] = defaultdict(list)
    async with Job(specs, config) as job:
        for round_ in range(rounds):
            requests = [
                GenerationRequest(
                    sample_id=f"r{round_}-{i}", token_ids=pack_tokens([1, 2, 3]), max_new_tokens=200
                )
                for i in range(8)
            ]
            job.submit("rollout", requests)
            await asyncio.sleep(0.3)  # generations are in flight on both engines
            moves = [
                ("rollout", "trainer"),
                ("trainer", "rollout"),
                ("rollout", "shadow"),
                ("shadow", "rollout"),
            ]
            for src, dst in moves:
                outcome = await job.move([1], src=src, dst=dst)
                assert outcome.ok, outcome.reason
                for record in outcome.records:
                    label = f"{record.kind}:{'grow' if 1 in record.dst_devices else 'shrink'}"
                    pauses[label].append((record.pause_s, record.bytes_moved))
            out = job.output("rollout")
            for _ in requests:
                await out.get(timeout=120)
    return pauses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    pauses = asyncio.run(measure(args.rounds, args.hidden))
    summary = {}
    for label in sorted(pauses):
        seconds = [p for p, _ in pauses[label]]
        moved = max(b for _, b in pauses[label])
        median_ms = statistics.median(seconds) * 1000
        print(
            f"{label:16s} n={len(seconds)}  median {median_ms:8.1f} ms  "
            f"max {max(seconds) * 1000:8.1f} ms  bytes {moved}"
        )
        summary[f"pause_ms_{label.replace(':', '_')}"] = round(median_ms, 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
