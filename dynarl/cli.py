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
    parser.add_subparsers(dest="command", required=True)
    return parser


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
