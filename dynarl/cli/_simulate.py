"""``dynarl simulate``: compare allocation policies on a workload in virtual time (the
command's options, their parsing and checks, and the runs)."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

from dynarl.cli._format import Formatter, Parser, unknown_choice

if TYPE_CHECKING:
    from dynarl.sim import Workload

__all__ = ["add_simulate"]

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


def add_simulate(commands: argparse._SubParsersAction[Parser]) -> None:
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
        formatter_class=Formatter,
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


def _policies(text: str) -> tuple[str, ...]:
    """``--policy``: the comma-separated policies, each checked against the simulator's."""
    from dynarl.sim.policies import POLICY_NAMES

    names = tuple(name.strip() for name in text.split(","))
    for name in names:
        if name not in POLICY_NAMES:
            raise argparse.ArgumentTypeError(
                unknown_choice("policy", name, POLICY_NAMES, plural="policies")
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
        return unknown_choice("field", name, fields, plural=plural, close=close)
    if dot:
        return unknown_choice("section", section, sections)
    listed = (
        ", ".join([*_SWEEP_ALIASES, *top])
        + ", or SECTION.FIELD for any field of the workload file, SECTION one of "
        + ", ".join(sections)
        + " (see docs/workloads.md)"
    )
    owners = [f"{s}.{key}" for s, names in sections.items() if key in names]
    every = [*_SWEEP_ALIASES, *top, *full]
    return unknown_choice("key", key, every, listed=listed, close=owners)


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
