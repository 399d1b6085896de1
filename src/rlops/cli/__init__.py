"""The ``rlops`` command: the table of subcommands (:data:`COMMANDS`: each a module with
``add_arguments(parser)``, which adds its options, and ``run(args)``, with its help line and
description); this module builds the parser and dispatches."""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

import rlops
from rlops.cli import bench, check, demo, profile

__all__ = ["main"]

#: name -> (module, help line of ``rlops --help``, description of ``rlops NAME --help``)
COMMANDS: dict[str, tuple[ModuleType, str, str]] = {
    "bench": (
        bench,
        "time rlops against the loops it replaces, on your shapes",
        "Time rlops beside the implementations it replaces (per-token and chunk loops for GAE "
        "and returns, per-sample loops for group estimators, log_softmax for log-probs, "
        "materialised logits and a top-p keep mask for the output layer), side by side in one "
        "run, and say in plain words what it buys; at agentic shapes, the fused output layer "
        "with a row mask of a few valid rows against every row, and kept sets as CSR against a "
        "dense keep mask.",
    ),
    "check": (
        check,
        "run rlops' numerics contract on your trainer's function",
        "Check a function of your trainer against rlops' definitions (rlops.testing); prints "
        "the report and exits 1 if a check failed.",
    ),
    "demo": (
        demo,
        "train a tiny policy with PPO on an exactly scored task",
        "Train a tiny transformer with PPO to reverse strings of symbols (reward: fraction "
        "reversed correctly, max 1), with every RL computation from rlops.",
    ),
    "profile": (
        profile,
        "time and measure each stage of one PPO step, naive beside rlops",
        "One PPO training step on a tiny transformer: per-stage time and peak memory, the "
        "common naive implementations beside rlops.",
    ),
}


def parser() -> argparse.ArgumentParser:
    """The ``rlops`` parser with every subcommand."""
    p = argparse.ArgumentParser(
        prog="rlops",
        description="rlops: the numerical core of RL for language models. The commands show, "
        "on your machine, what it buys, and check your trainer's numerics.",
    )
    p.add_argument("--version", action="version", version=f"rlops {rlops.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_line, description) in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_line, description=description))
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run the chosen subcommand; an unknown
    option is a usage error of that subcommand (its own usage line, exit code 2)."""
    p = parser()
    args, unknown = p.parse_known_args(argv)
    if unknown:
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return COMMANDS[args.command][0].run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
