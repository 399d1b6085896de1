"""Argument types and checks shared by the ``rlops`` subcommands and ``benchmarks/``.

A bad value is an ``argparse`` usage error: the command's usage line, ``<command>: error:
...`` and exit code 2, before anything is measured. Output files are checked by opening them
(a file that did not exist is removed again), and ``--plot`` by importing matplotlib, so that
neither fails after the whole measurement has run.
"""

from __future__ import annotations

import argparse
import os

import torch

__all__ = [
    "add_device",
    "add_outputs",
    "add_threads",
    "default_device",
    "device",
    "plot_path",
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
    """An output file that can be created or overwritten, checked by opening it for appending
    (which changes nothing in a file that exists; one that did not is removed again)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, expected a file path")
    existed = os.path.lexists(text)
    try:
        with open(text, "a"):
            pass
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {err.strerror}") from None
    if not existed:
        os.remove(text)
    return text


def plot_path(text: str) -> str:
    """A PNG to write: ``.png`` added to a name without it, matplotlib importable, the file
    writable (:func:`writable_path`)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError(
            "drawing needs matplotlib, which is not installed (pip install matplotlib)"
        ) from None
    if os.path.isdir(text) or text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, expected a file path")
    return writable_path(text if text.lower().endswith(".png") else text + ".png")


def add_device(parser: argparse.ArgumentParser) -> None:
    """``--device``, checked at parse time (:func:`device`)."""
    parser.add_argument(
        "--device",
        type=device,
        default=default_device(),
        help=f"cpu, cuda or cuda:N (default {default_device()})",
    )


def add_threads(parser: argparse.ArgumentParser, text: str) -> None:
    """``--threads N``: torch's intra-op thread count for the run; ``text`` ends the help."""
    parser.add_argument(
        "--threads",
        metavar="N",
        type=positive_int,
        help=f"torch intra-op threads (default: torch's choice, {torch.get_num_threads()} "
        f"here); {text}",
    )


def add_outputs(parser: argparse.ArgumentParser, *, json: str, plot: str) -> None:
    """``--json PATH`` (:func:`writable_path`) and ``--plot PATH`` (:func:`plot_path`), checked at
    parse time; ``json`` and ``plot``: what each writes, for the help."""
    parser.add_argument("--json", metavar="PATH", type=writable_path, help=json)
    parser.add_argument("--plot", metavar="PATH", type=plot_path, help=plot + " (PNG)")
