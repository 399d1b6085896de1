"""The ``rlops`` command: ``rlops bench`` shows, on your shapes and machine, what rlops buys."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from rlops.cli import demo, profile
from rlops.cli.options import positive_int

__all__ = ["main"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SECTIONS = ("advantages", "group", "logprobs")
# (name, module with add_arguments(subparsers) and run(args))
_EXTRA_COMMANDS: list = [("demo", demo), ("profile", profile)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time rlops against the loops it replaces, on your shapes")
    bench.add_argument("--batch", type=positive_int, default=8, help="rows B (default 8)")
    bench.add_argument(
        "--seq-len",
        type=positive_int,
        nargs="+",
        default=[4096, 32768, 131072],
        help="sequence lengths T for the advantages (default 4096 32768 131072)",
    )
    bench.add_argument("--vocab", type=positive_int, default=32000, help="vocabulary V")
    bench.add_argument(
        "--logprob-tokens",
        type=positive_int,
        nargs="+",
        default=[1024, 4096],
        help="token counts for the log-prob section (default 1024 4096)",
    )
    bench.add_argument(
        "--group-batch",
        type=positive_int,
        default=256,
        help="samples for the group estimators (groups of 8, T = the smallest --seq-len)",
    )
    bench.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="which sections to run (default: all)",
    )
    bench.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    bench.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    bench.add_argument("--gamma", type=float, default=1.0)
    bench.add_argument("--lam", type=float, default=0.95)
    bench.add_argument("--repeats", type=positive_int, default=10, help="timed runs per method")
    bench.add_argument("--quick", action="store_true", help="small shapes, seconds in all")
    bench.add_argument("--json", metavar="PATH", help="also write the measurements as JSON")
    bench.add_argument("--plot", metavar="PATH", help="also draw time vs size as a PNG")
    for _, module in _EXTRA_COMMANDS:
        module.add_arguments(sub)
    return parser


def _fmt_ms(seconds: float, extrapolated: bool) -> str:
    ms = seconds * 1e3
    text = f"{ms:,.3f}" if ms < 10 else f"{ms:,.1f}"
    return ("~" + text) if extrapolated else text


def _fmt_mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:,.1f}"


def print_table(title: str, header: list[str], lines: list[list[str]]) -> None:
    """A rich table when rich is installed, else aligned plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
        print(title)
        for r in [header, *lines]:
            cells = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
            print("  ".join(cells))
        return
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in lines:
        table.add_row(*r)
    Console().print(table)


class _Progress:
    """A progress bar over the bench's steps (rich when installed; silent otherwise)."""

    def __init__(self, total: int):
        self.total = total
        self._bar = None
        try:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._task = self._bar.add_task("measuring", total=total)
        except ImportError:
            pass

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
        return self

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()


def _bench(args: argparse.Namespace) -> int:
    from rlops.cli import bench as b
    from rlops.cli.measure import keep_freed_memory
    from rlops.cli.report import plot_rows, verdicts

    tuned = keep_freed_memory()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("rlops bench: error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1):
        print("rlops bench: error: --gamma and --lam must lie in [0, 1]", file=sys.stderr)
        return 2
    if args.quick:
        args.seq_len, args.logprob_tokens = [256, 2048], [256]
        args.vocab, args.group_batch, args.repeats = min(args.vocab, 4096), 64, 3
    dtype = _DTYPES[args.dtype]
    print(
        f"rlops bench: B={args.batch}, T={args.seq_len}, {args.dtype}, gamma={args.gamma}, "
        f"lam={args.lam}, device={device}, torch threads={torch.get_num_threads()}"
        + (", malloc keeps freed memory" if tuned else "")
    )
    rows: list = []
    steps = (
        len(args.seq_len) * ("advantages" in args.sections)
        + len(args.logprob_tokens) * ("logprobs" in args.sections)
        + ("group" in args.sections)
    )
    with _Progress(steps) as progress:
        if "advantages" in args.sections:
            rows += b.bench_advantages(
                args.batch,
                args.seq_len,
                dtype=dtype,
                device=device,
                gamma=args.gamma,
                lam=args.lam,
                repeats=args.repeats,
                progress=progress.advance,
            )
        if "group" in args.sections:
            rows += b.bench_group(
                args.group_batch, min(args.seq_len), device=device, repeats=args.repeats
            )
            progress.advance()
        if "logprobs" in args.sections:
            rows += b.bench_logprobs(
                args.logprob_tokens, args.vocab, device=device, progress=progress.advance
            )
    _print_rows(rows, args.batch, dtype)
    for line in verdicts(rows, batch=args.batch, vocab=args.vocab):
        print(line)
    if args.json:
        payload = {
            "command": "bench",
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "rows": [dataclasses.asdict(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    if args.plot:
        plot_rows(rows, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _print_rows(rows: list, batch: int, dtype: torch.dtype) -> None:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    keys = list(dict.fromkeys((r.section, r.case, r.shape) for r in rows))
    for section, case, shape in keys:
        group = [r for r in rows if (r.section, r.case, r.shape) == (section, case, shape)]
        ours = next((r for r in group if r.ours), group[-1])
        lines = []
        for r in group:
            peak = _fmt_mib(r.peak_bytes)
            if section != "logprobs" and r.peak_bytes is not None:
                peak += f" ({r.peak_bytes / (batch * r.size * itemsize):.2f} x [B,T])"
            lines.append(
                [
                    r.method,
                    _fmt_ms(r.seconds, r.extrapolated),
                    f"{r.seconds / ours.seconds:,.2f}",
                    peak,
                ]
            )
        print_table(
            f"{case} [{shape}]",
            ["method", "median ms", "time / rlops", "peak extra MiB"],
            lines,
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    for name, module in _EXTRA_COMMANDS:
        if args.command == name:
            return module.run(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
