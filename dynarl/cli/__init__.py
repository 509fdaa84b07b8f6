"""The ``dynarl`` command line.

Subcommands are registered in :func:`build_parser`; each one is a thin wrapper around a
public API call, so everything the CLI does can also be done from Python. What the help
prints is written for the people who run the command (plain text, no reST markup): a
one-line summary per command, options in groups with their defaults and choices, and
examples; a mistyped choice is answered with the valid ones and the closest match.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import dynarl
from dynarl.cli import _format, _simulate

__all__ = ["build_parser", "main"]

_DESCRIPTION = """\
dynarl: a dynamic scheduler inside RL post-training jobs. It moves devices between
rollout, inference, tools and trainer while the job runs."""

_EPILOG = """\
examples:
  dynarl demo                     # a real GRPO job on this machine (a few minutes)
  dynarl events RUN_DIR           # then: what the scheduler did in it, and why
  dynarl simulate examples/workloads/math-7b-64gpu.toml --policy static-split,dynarl

Run 'dynarl COMMAND --help' for a command's options."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = _format.Parser(
        prog="dynarl", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_format.Formatter
    )
    parser.add_argument("--version", action="version", version=f"dynarl {dynarl.__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, title="commands", metavar="COMMAND"
    )
    _add_demo(commands)
    _simulate.add_simulate(commands)
    _add_events(commands)
    _add_keys(commands)
    return parser


def _add_keys(commands: argparse._SubParsersAction[_format.Parser]) -> None:
    keys = commands.add_parser(
        "keys",
        help="generate a CURVE key pair for one node (run outside the job)",
        description="Generate a CURVE key pair for one node of a multi-node job: write "
        "NAME.key (public) and NAME.key_secret (mode 0600, keep it on that node) into "
        "--dir. See docs/torchrun.md.",
        epilog="example:\n  dynarl keys node0 --dir /etc/dynarl   # node0.key, node0.key_secret",
        formatter_class=_format.Formatter,
    )
    keys.add_argument("name", metavar="NAME", help="node name, e.g. controller or node-3")
    keys.add_argument("--dir", default=".", help="directory for the key files")
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


def _add_demo(commands: argparse._SubParsersAction[_format.Parser]) -> None:
    from dynarl import demo

    parser = commands.add_parser(
        "demo",
        help=demo.SUMMARY,
        description=demo.DESCRIPTION,
        epilog="examples:\n"
        "  dynarl demo                        # the default job, one device per core\n"
        "  dynarl demo --steps 2 --prompts 8  # a shorter run\n"
        "  dynarl demo --mode hybrid          # asynchronous GRPO with hybrid replicas\n"
        "  dynarl events RUN_DIR              # then: what the scheduler did, and why",
        formatter_class=_format.Formatter,
    )
    demo.add_arguments(parser)
    parser.set_defaults(handler=demo.main)


def _add_events(commands: argparse._SubParsersAction[_format.Parser]) -> None:
    events = commands.add_parser(
        "events",
        help="summarise a run's ledger: moves, costs, gains, prediction error, rejections",
        description="Read RUN_DIR/events.jsonl (or a ledger file) and print what the "
        "scheduler did: moves by kind and component, predicted vs realised gain per move, "
        "prediction error, migration bytes and pauses, cache loss, rejected plans by "
        "reason, time in safe mode. The ledger of a job that crashed reads too: a last line "
        "cut off mid-write is skipped, with a warning. Fields and charts: "
        "docs/observability.md.",
        epilog="examples:\n"
        "  dynarl events runs/demo-20250101-120000   # a run directory of dynarl demo\n"
        "  dynarl events run/events.jsonl --json > summary.json\n"
        "  dynarl events run --plot                  # charts into run/plots",
        formatter_class=_format.Formatter,
    )
    events.add_argument("run_dir", metavar="RUN_DIR", help="run directory or ledger file")
    out = events.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON document, no text")
    out.add_argument(
        "--plot",
        metavar="DIR",
        nargs="?",
        const="",
        help="also draw allocation, utilization and throughput charts into DIR (DIR left out: "
        "RUN_DIR/plots; default: no charts)",
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
    source = str(ledger_path)
    read = ledger.file
    if read is not None and read.skipped_bytes:
        print(
            f"dynarl events: warning: {source} ends in a torn line (no newline, not JSON: "
            f"the job stopped while writing it); skipped its {read.skipped_bytes} bytes and "
            f"read the {read.num_lines} complete line{'' if read.num_lines == 1 else 's'} "
            "before it",
            file=sys.stderr,
        )
    summary = summarise_ledger(ledger)
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
    """Entry point of the ``dynarl`` script; returns the process exit status (2 for a
    usage error, which argparse reports with the usage line; 0 after --help)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help, --version, a usage error: argparse has printed
        code = exit_.code
        return code if isinstance(code, int) else 0 if code is None else 2
    handler = getattr(args, "handler", None)
    if handler is None:
        print(f"dynarl: unknown command {args.command!r}", file=sys.stderr)
        return 2
    try:
        status: int = handler(args)
    except BrokenPipeError:  # `dynarl events ... | head`: the reader has what it wanted
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
