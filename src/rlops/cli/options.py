"""Argument types and checks shared by the ``rlops`` subcommands.

A bad value is an ``argparse`` usage error: the subcommand's usage line, ``rlops <command>:
error: ...`` and exit code 2, before anything is measured.
"""

from __future__ import annotations

import argparse
import os

import torch

__all__ = [
    "add_device",
    "add_outputs",
    "default_device",
    "device",
    "positive_int",
    "top_p",
    "writable_path",
]


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def top_p(text: str) -> float:
    """A top-p sampler's mass: a number in ``(0, 1]``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


def default_device() -> str:
    """``cuda`` where a CUDA device is available, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, and only a CUDA device that is present."""
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise argparse.ArgumentTypeError(f"{text!r}: only {count} CUDA device(s) present")
    return text


def writable_path(text: str) -> str:
    """An output file that can be created or overwritten (its folder exists and is writable),
    checked before any measurement so that a typo does not cost the whole run."""
    folder = os.path.dirname(os.path.abspath(text)) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, expected a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no folder {folder!r}")
    writable = os.access(text, os.W_OK) if os.path.exists(text) else os.access(folder, os.W_OK)
    if not writable:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text


def add_device(parser: argparse.ArgumentParser) -> None:
    """``--device``, checked at parse time (:func:`device`)."""
    parser.add_argument(
        "--device",
        type=device,
        default=default_device(),
        help=f"cpu, cuda or cuda:N (default {default_device()})",
    )


def add_outputs(parser: argparse.ArgumentParser, *, json: str, plot: str) -> None:
    """``--json PATH`` and ``--plot PATH`` (PNG), checked at parse time (:func:`writable_path`);
    ``json`` and ``plot``: what each writes, for the help."""
    for flag, text in (("--json", json), ("--plot", plot)):
        parser.add_argument(flag, metavar="PATH", type=writable_path, help=text)
