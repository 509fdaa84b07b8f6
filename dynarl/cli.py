"""The ``dynarl`` command line.

Subcommands are registered in :func:`build_parser`; each one is a thin wrapper around a
public API call, so everything the CLI does can also be done from Python.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import dynarl

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="dynarl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dynarl {dynarl.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_keys(commands)
    _add_demo(commands)
    _add_simulate(commands)
    _add_events(commands)
    return parser


def _add_keys(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = commands.add_parser(
        "keys",
        help="generate a CURVE key pair for one node (run outside the job)",
        description="Write NAME.key (public) and NAME.key_secret (mode 0600) into --dir.",
    )
    keys.add_argument("name", help="node name, e.g. controller or node-3")
    keys.add_argument("--dir", default=".", help="directory for the key files (default: .)")
    keys.set_defaults(handler=_keys)


def _keys(args: argparse.Namespace) -> int:
    from dynarl.bus import generate_keys, load_public_key

    try:
        public, secret = generate_keys(args.dir, args.name)
    except ValueError as exc:
        print(f"dynarl keys: {exc}", file=sys.stderr)
        return 1
    print(f"public key  {public}  ({load_public_key(public).decode()})")
    print(f"secret key  {secret}  (mode 0600; keep it on this node)")
    return 0


def _add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from dynarl import demo

    parser = commands.add_parser("demo", help=demo.SUMMARY, description=demo.DESCRIPTION)
    demo.add_arguments(parser)
    parser.set_defaults(handler=demo.main)


def _add_simulate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = commands.add_parser(
        "simulate",
        help="compare allocation policies on a workload in virtual time",
        description="Simulate a workload (TOML) under each policy on the same trace and "
        "print throughput, iteration time, speedups, moves, migration and idle shares.",
    )
    sim.add_argument("workload", help="workload TOML file (see docs/workloads.md)")
    sim.add_argument(
        "--policy",
        default=None,
        help="comma-separated policies (default: all; with --sweep: dynarl)",
    )
    sim.add_argument("--json", action="store_true", help="print one JSON document instead")
    sim.add_argument("--plot", metavar="DIR", help="write an allocation-timeline PNG per policy")
    sim.add_argument(
        "--sweep",
        metavar="KEY=V1,V2,...",
        help="repeat for each value of a parameter (e.g. u_low=0.01,0.1,0.2,0.3,0.5 or "
        "t_window=4,32,64 or scheduler.min_move_interval_s=5,10)",
    )
    sim.add_argument(
        "--vector",
        action="store_true",
        help="vectorised per-engine rollout model (math workloads at scale)",
    )
    sim.add_argument("--verbose", action="store_true", help="log the scheduler's warnings")
    sim.set_defaults(handler=_simulate)


def _parse_value(text: str) -> object:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def _simulate(args: argparse.Namespace) -> int:
    import json
    import logging

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR,
        format="%(levelname)s %(name)s: %(message)s",
    )

    from dynarl.sim import (
        compare,
        format_table,
        load_workload,
        plot_timelines,
        results_json,
        with_overrides,
    )
    from dynarl.sim.policies import POLICY_NAMES

    try:
        workload = load_workload(args.workload)
    except (OSError, ValueError) as err:
        print(f"dynarl simulate: {err}", file=sys.stderr)
        return 2
    default = ("dynarl",) if args.sweep else POLICY_NAMES
    policies = tuple(p.strip() for p in args.policy.split(",")) if args.policy else default
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        print(f"dynarl simulate: unknown policies {unknown}", file=sys.stderr)
        return 2
    runs: list[tuple[str, object]] = [("", None)]
    key = ""
    if args.sweep:
        key, _, values = args.sweep.partition("=")
        if not key or not values:
            print("dynarl simulate: --sweep needs KEY=V1,V2,...", file=sys.stderr)
            return 2
        runs = [(f"{key}={v}", _parse_value(v)) for v in values.split(",")]
    documents = []
    for label, value in runs:
        try:
            current = with_overrides(workload, {key: value}) if label else workload
            results = compare(current, policies, vector=args.vector)
        except ValueError as err:
            print(f"dynarl simulate: {err}", file=sys.stderr)
            return 2
        title = f"{workload.name}" + (f"  [{label}]" if label else "")
        if args.json:
            documents.append(json.loads(results_json(results, workload=title)))
        else:
            print(format_table(results, title=title))
            print()
        if args.plot:
            prefix = f"{workload.name}-" + (f"{label}-" if label else "")
            paths = plot_timelines(
                {r.policy: r.timeline for r in results}, args.plot, prefix=prefix
            )
            if not args.json:
                print("plots: " + ", ".join(str(p) for p in paths))
    if args.json:
        doc = documents[0] if not args.sweep else {"sweep": key, "runs": documents}
        print(json.dumps(doc, indent=2))
    return 0


def _add_events(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    events = commands.add_parser(
        "events",
        help="summarise a run's ledger: moves, costs, gains, prediction error, rejections",
        description="Read RUN_DIR/events.jsonl (or a ledger file) and print what the scheduler "
        "did: moves by kind and component, predicted vs realised gain per move, prediction "
        "error, migration bytes and pauses, cache loss, rejected plans by reason, time in "
        "safe mode.",
    )
    events.add_argument("run_dir", metavar="RUN_DIR", help="run directory or ledger file")
    events.add_argument("--json", action="store_true", help="print one JSON document instead")
    events.add_argument(
        "--plot",
        metavar="DIR",
        nargs="?",
        const="",
        help="draw allocation, utilization and throughput charts (default DIR: RUN_DIR/plots)",
    )
    events.set_defaults(handler=_events)


def _events(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dynarl.sched import Ledger, format_summary, plot_ledger, summarise_ledger, summary_json

    path = Path(args.run_dir)
    ledger_path = path / "events.jsonl" if path.is_dir() else path
    try:
        ledger = Ledger.load(ledger_path)
    except (OSError, ValueError) as err:
        print(f"dynarl events: {err}", file=sys.stderr)
        return 2
    summary = summarise_ledger(ledger)
    source = str(ledger_path)
    print(
        summary_json(summary, source=source)
        if args.json
        else format_summary(summary, source=source)
    )
    if args.plot is not None:
        directory = Path(args.plot) if args.plot else ledger_path.parent / "plots"
        paths = plot_ledger(ledger, directory, title=path.name)
        print(
            "plots: " + ", ".join(str(p) for p in paths),
            file=sys.stderr if args.json else sys.stdout,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dynarl`` script; returns the process exit status."""
    args = build_parser().parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        print(f"dynarl: unknown command {args.command!r}", file=sys.stderr)
        return 2
    status: int = handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
