"""The ``rlops`` command: each subcommand (a module with ``add_arguments(subparsers)`` and
``run(args)``) registers its options; this module only dispatches."""

from __future__ import annotations

import argparse
import sys

import rlops
from rlops.cli import bench, check, demo, profile

__all__ = ["main"]

COMMANDS = {"bench": bench, "check": check, "demo": demo, "profile": profile}


def parser() -> argparse.ArgumentParser:
    """The ``rlops`` parser with every subcommand."""
    p = argparse.ArgumentParser(
        prog="rlops",
        description="rlops: the numerical core of RL for language models. The commands show, "
        "on your machine, what it buys, and check your trainer's numerics.",
    )
    p.add_argument("--version", action="version", version=f"rlops {rlops.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for module in COMMANDS.values():
        module.add_arguments(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run the chosen subcommand; an unknown
    option is a usage error of that subcommand (its own usage line, exit code 2)."""
    p = parser()
    args, unknown = p.parse_known_args(argv)
    if unknown:
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
