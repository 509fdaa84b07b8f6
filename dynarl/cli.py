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

    parser = commands.add_parser("demo", help=demo.SUMMARY, description=demo.__doc__)
    demo.add_arguments(parser)
    parser.set_defaults(handler=demo.main)


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
