"""A mixture-of-experts trainer with and without expert-parallel reshards, against static.

Runs a workload (by default the Qwen3-30B-A3B one, ``moe/math-qwen3-30b-a3b-64gpu.toml``)
under the static policies of the other tables (``static-sequential``, ``static-split``),
under ``dynarl`` as the file is (the trainer resharded P2P, expert-parallel layout
included) and under ``dynarl`` with the trainer limited to reboots (the same file with
``[migration] trainer_kind = "reboot"``: the MoE trainer dynarl could move before it
resharded expert parallelism). Every run sees the same trace; speedups compare mean
measured iteration times (the same tokens per iteration). Prints a table, then one JSON
line.

Run: .venv/bin/python examples/workloads/moe_table.py [WORKLOAD] (about two minutes on
two loaded cores).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dynarl.sim import Workload, load_workload, run_policy, with_overrides

DEFAULT = Path(__file__).resolve().parent / "moe" / "math-qwen3-30b-a3b-64gpu.toml"
STATIC = ("static-sequential", "static-split")

Row = tuple[str, str, dict[str, object]]
"""A table row: its label, how its trainer moves, and its run's JSON record."""


def runs(workload: Workload) -> list[Row]:
    """A row for every policy the table compares."""
    rebooting = with_overrides(workload, {"migration.trainer_kind": "reboot"})
    out = [(name, "-", run_policy(workload, name).record()) for name in STATIC]
    out.append(("dynarl, EP reshard", "p2p", run_policy(workload, "dynarl").record()))
    out.append(("dynarl, reboot only", "reboot", run_policy(rebooting, "dynarl").record()))
    return out


def table(workload: Workload, rows: list[Row]) -> str:
    """The rows as a Markdown table, speedups over static-sequential and the best static."""
    times = {label: float(r["iteration_s"]) for label, _, r in rows}  # type: ignore[arg-type]
    sequential = times["static-sequential"]
    best = min(times[name] for name in STATIC)
    lines = [
        f"{workload.name}: trainer p2p_s = {workload.migration.p2p_s} s, "
        f"reboot_s = {workload.migration.reboot_s} s",
        "",
        "| policy | trainer moves by | iteration | throughput | × static-sequential "
        "| × best static | moves / iteration | migration share | idle share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, kind, r in rows:
        t = times[label]
        lines.append(
            f"| {label} | {kind} | {t:.1f} s | {r['throughput']:,.0f} {r['unit']} "
            f"| {sequential / t:.3f} | {best / t:.3f} | {r['moves']:.1f} "
            f"| {r['migration_share']:.1%} | {r['idle_share']:.1%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", nargs="?", default=str(DEFAULT), help="workload file")
    args = parser.parse_args(argv)
    try:
        workload = load_workload(args.workload)
    except (OSError, ValueError) as err:
        print(f"moe_table: {err}", file=sys.stderr)
        return 2
    rows = runs(workload)
    print(table(workload, rows))
    record = {
        "workload": workload.name,
        "runs": [{"label": label, "trainer": kind, **r} for label, kind, r in rows],
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
