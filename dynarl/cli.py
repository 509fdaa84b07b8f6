"""The ``dynarl`` command line.

Subcommands are registered in :func:`build_parser`; each one is a thin wrapper around a
public API call, so everything the CLI does can also be done from Python. What the help
prints is written for the people who run the command (plain text, no reST markup): a
one-line summary per command, options in groups with their defaults and choices, and
examples; a mistyped choice is answered with the valid ones and the closest match.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import dynarl

if TYPE_CHECKING:
    from dynarl.sim import Workload

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

_POLICIES = (
    "static-sequential",
    "static-split",
    "rlinf-rule",
    "verl-hybrid",
    "dynarl",
    "dynarl+priority",
)
"""The simulator's policies as the help lists them (importing ``dynarl.sim.policies``
would slow every command's start; the tests keep this equal to its ``POLICY_NAMES``,
which is what ``--policy`` is checked against)."""

_SWEEP_ALIASES = {"u_low": "scheduler.util_low", "t_window": "scheduler.donor_window_s"}
"""The short sweep keys the simulator accepts (its ``SWEEP_ALIASES``; the tests keep the
two equal)."""


class _Formatter(argparse.HelpFormatter):
    """Descriptions and epilogs by paragraph (blank-line separated): a paragraph with an
    indented line (a list, example commands) is kept as written, the others are filled to
    the terminal's width. Each option's help ends with its default unless it says the
    default itself or has none to show."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        # Not at hyphens: names such as static-sequential and --no-live stay whole.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        paragraphs = []
        for paragraph in text.strip("\n").split("\n\n"):
            if paragraph.startswith(" ") or "\n " in paragraph:
                paragraphs.append(textwrap.indent(paragraph, indent))
            else:
                words = " ".join(paragraph.split())
                paragraphs.append(
                    textwrap.fill(
                        words,
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                        break_on_hyphens=False,
                    )
                )
        return "\n\n".join(paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.option_strings
            and action.default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too) adding the closest valid choice to an
    invalid-choice error (a command, --task, --mode)."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            choices = [str(choice) for choice in action.choices or ()]
            close = difflib.get_close_matches(str(value), choices, n=1)
            if not close:
                raise
            raise argparse.ArgumentError(
                action, f"{exc.message} (did you mean {close[0]}?)"
            ) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = _Parser(
        prog="dynarl", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_Formatter
    )
    parser.add_argument("--version", action="version", version=f"dynarl {dynarl.__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, title="commands", metavar="COMMAND"
    )
    _add_demo(commands)
    _add_simulate(commands)
    _add_events(commands)
    _add_keys(commands)
    return parser


def _add_keys(commands: argparse._SubParsersAction[_Parser]) -> None:
    keys = commands.add_parser(
        "keys",
        help="generate a CURVE key pair for one node (run outside the job)",
        description="Generate a CURVE key pair for one node of a multi-node job: write "
        "NAME.key (public) and NAME.key_secret (mode 0600, keep it on that node) into "
        "--dir. See docs/torchrun.md.",
        epilog="example:\n  dynarl keys node0 --dir /etc/dynarl   # node0.key, node0.key_secret",
        formatter_class=_Formatter,
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


def _add_demo(commands: argparse._SubParsersAction[_Parser]) -> None:
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
        formatter_class=_Formatter,
    )
    demo.add_arguments(parser)
    parser.set_defaults(handler=demo.main)


def _add_simulate(commands: argparse._SubParsersAction[_Parser]) -> None:
    sim = commands.add_parser(
        "simulate",
        help="compare allocation policies on a workload in virtual time",
        description="Simulate an RL job described by a workload file under each allocation "
        "policy, on the same trace and in virtual time, and print throughput, iteration "
        "time, speedups, moves, migration and idle shares. No GPU needed. A shipped "
        "workload takes from under a minute to a few minutes with every policy on a "
        "2-core machine; name fewer with --policy. File format: docs/workloads.md; "
        "shipped workloads: examples/workloads/.",
        epilog="examples:\n"
        "  dynarl simulate examples/workloads/math-7b-64gpu.toml\n"
        "  dynarl simulate examples/workloads/math-7b-64gpu.toml --policy dynarl --json\n"
        "  dynarl simulate examples/workloads/math-7b-64gpu.toml --plot plots\n"
        "  dynarl simulate examples/workloads/math-1.5b-64gpu.toml --sweep u_low=0.1,0.3",
        formatter_class=_Formatter,
    )
    sim.add_argument(
        "workload", metavar="WORKLOAD", help="workload TOML file (format: docs/workloads.md)"
    )
    run = sim.add_argument_group("what to simulate")
    run.add_argument(
        "--policy",
        metavar="P1,P2,...",
        type=_policies,
        default=None,
        help="comma-separated policies, from: " + ", ".join(_POLICIES) + " (default: all of "
        "them; with --sweep: static-sequential,dynarl)",
    )
    run.add_argument(
        "--sweep",
        metavar="KEY=V1,V2,...",
        type=_sweep,
        help="simulate once for each value of one workload setting and print one table, a "
        "row per value and policy. KEY: u_low (the scheduler's U_low), t_window (its T), a "
        "top-level key such as seed, or SECTION.FIELD for any field of the file, e.g. "
        "u_low=0.01,0.1,0.3 or scheduler.min_move_interval_s=5,10 (default: no sweep)",
    )
    run.add_argument(
        "--vector",
        action="store_true",
        help="vectorised per-engine rollout model (math workloads at scale)",
    )
    out = sim.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON document, no table")
    out.add_argument(
        "--plot",
        metavar="DIR",
        help="also write PNGs into DIR: an allocation timeline per policy, all on one time "
        "axis, and one of every policy side by side; with --sweep, these for each value and "
        "one chart of iteration time, throughput and speedup against the swept value",
    )
    out.add_argument("--verbose", action="store_true", help="log the scheduler's warnings")
    sim.set_defaults(handler=_simulate)


def _unknown(
    what: str,
    name: str,
    valid: Iterable[str],
    *,
    plural: str = "",
    listed: str = "",
    close: Sequence[str] = (),
) -> str:
    """An unknown choice: the valid ones and, when some are close (``close``, else the
    closest of ``valid``), a suggestion. ``listed`` replaces the list of ``valid``."""
    options = list(valid)
    close = close or difflib.get_close_matches(name, options, n=1)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    listed = listed or ", ".join(options)
    return f"unknown {what} {name!r}{hint}; valid {plural or what + 's'}: {listed}"


def _policies(text: str) -> tuple[str, ...]:
    """``--policy``: the comma-separated policies, each checked against the simulator's."""
    from dynarl.sim.policies import POLICY_NAMES

    names = tuple(name.strip() for name in text.split(","))
    for name in names:
        if name not in POLICY_NAMES:
            raise argparse.ArgumentTypeError(
                _unknown("policy", name, POLICY_NAMES, plural="policies")
            )
    return names


class _Sweep(NamedTuple):
    """``--sweep KEY=V1,V2,...``."""

    key: str
    values: tuple[str, ...]


def _sweep(text: str) -> _Sweep:
    """``--sweep``: split, and the key checked against what a workload file has."""
    key, _, values = text.partition("=")
    if not key or not values:
        raise argparse.ArgumentTypeError(
            f"expected KEY=V1,V2,... (e.g. u_low=0.1,0.3), got {text!r}"
        )
    problem = _sweep_key_problem(key)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return _Sweep(key, tuple(values.split(",")))


def _workload_keys() -> tuple[list[str], dict[str, list[str]]]:
    """A workload file's top-level keys and each section's fields, from ``Workload``."""
    import dataclasses
    import typing

    from dynarl.sim import Workload

    hints = typing.get_type_hints(Workload)
    top: list[str] = []
    sections: dict[str, list[str]] = {}
    for field in dataclasses.fields(Workload):
        hint = hints[field.name]
        classes: list[Any] = [
            c for c in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(c)
        ]
        if classes:
            sections[field.name] = [f.name for f in dataclasses.fields(classes[0])]
        elif field.name != "notes":  # free text, not a setting
            top.append(field.name)
    return top, sections


def _sweep_key_problem(key: str) -> str:
    """Why ``key`` is not a sweep key (valid keys, a suggestion), or "" when it is one."""
    top, sections = _workload_keys()
    full = [f"{s}.{name}" for s, names in sections.items() for name in names]
    if key in _SWEEP_ALIASES or key in top or key in full:
        return ""
    section, dot, name = key.rpartition(".")
    if dot and section in sections:
        fields = sections[section]
        close = [f"{section}.{f}" for f in difflib.get_close_matches(name, fields, n=1)]
        plural = f"fields of [{section}]"
        return _unknown("field", name, fields, plural=plural, close=close)
    if dot:
        return _unknown("section", section, sections)
    listed = (
        ", ".join([*_SWEEP_ALIASES, *top])
        + ", or SECTION.FIELD for any field of the workload file, SECTION one of "
        + ", ".join(sections)
        + " (see docs/workloads.md)"
    )
    owners = [f"{s}.{key}" for s, names in sections.items() if key in names]
    every = [*_SWEEP_ALIASES, *top, *full]
    return _unknown("key", key, every, listed=listed, close=owners)


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
    import logging

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR,
        format="%(levelname)s %(name)s: %(message)s",
    )

    from dynarl.sim import compare, format_table, load_workload, plot_timelines, results_json
    from dynarl.sim.policies import POLICY_NAMES

    try:
        workload = load_workload(args.workload)
        if args.sweep:  # a _Sweep, its key checked by _sweep
            return _simulate_sweep(args, workload)
        results = compare(workload, args.policy or POLICY_NAMES, vector=args.vector)
    except (OSError, ValueError) as err:
        print(f"dynarl simulate: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(results_json(results, workload=workload.name))
    else:
        print(format_table(results, title=workload.name))
        print()
    if args.plot:
        timelines = {r.policy: r.timeline for r in results}
        paths = plot_timelines(timelines, args.plot, prefix=f"{workload.name}-")
        if not args.json:
            print("plots: " + ", ".join(str(p) for p in paths))
    return 0


_SWEEP_POLICIES = ("static-sequential", "dynarl")
"""The policies a sweep runs unless ``--policy`` names others: dynarl and its speedup."""


def _simulate_sweep(args: argparse.Namespace, workload: Workload) -> int:
    """``simulate --sweep``: the policies once per value, one table of them all, and with
    ``--plot`` the timelines of each value and one chart of the figures against the
    value. Raises ValueError for a value the workload refuses."""
    import json

    from dynarl.sim import (
        compare,
        format_sweep,
        plot_sweep,
        plot_timelines,
        results_json,
        with_overrides,
    )

    key: str = args.sweep.key
    policies: tuple[str, ...] = args.policy or _SWEEP_POLICIES  # checked by _policies
    points = []
    paths = []
    for text in args.sweep.values:
        value = _parse_value(text)
        results = compare(with_overrides(workload, {key: value}), policies, vector=args.vector)
        points.append((value, results))
        if args.plot:
            timelines = {r.policy: r.timeline for r in results}
            paths += plot_timelines(timelines, args.plot, prefix=f"{workload.name}-{key}={text}-")
    title = f"{workload.name}, swept over {key}"
    if args.plot:
        paths.insert(0, plot_sweep(key, points, args.plot, prefix=f"{workload.name}-", title=title))
    if args.json:
        runs = [
            json.loads(
                results_json(r, workload=f"{workload.name}  [{key}={v}]", extra={"value": v})
            )
            for v, r in points
        ]
        print(json.dumps({"sweep": key, "runs": runs}, indent=2))
        return 0
    print(format_sweep(key, points, title=title))
    if paths:
        print("\nplots: " + ", ".join(str(p) for p in paths))
    return 0


def _add_events(commands: argparse._SubParsersAction[_Parser]) -> None:
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
        formatter_class=_Formatter,
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
