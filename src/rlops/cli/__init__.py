"""The ``rlops`` command: ``rlops bench`` shows, on your shapes and machine, what rlops buys."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

__all__ = ["main"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time rlops against the loops it replaces")
    bench.add_argument("--batch", type=_positive_int, default=8, help="rows B (default 8)")
    bench.add_argument(
        "--seq-len",
        type=_positive_int,
        nargs="+",
        default=[4096, 32768, 131072],
        help="sequence lengths T (default 4096 32768 131072)",
    )
    bench.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    bench.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    bench.add_argument("--gamma", type=float, default=1.0)
    bench.add_argument("--lam", type=float, default=0.95)
    bench.add_argument("--repeats", type=_positive_int, default=10, help="timed runs per method")
    bench.add_argument("--quick", action="store_true", help="small shapes, seconds in all")
    bench.add_argument("--json", metavar="PATH", help="also write the measurements as JSON")
    return parser


def _fmt_ms(seconds: float, extrapolated: bool) -> str:
    ms = seconds * 1e3
    text = f"{ms:,.3f}" if ms < 10 else f"{ms:,.1f}"
    return ("~" + text) if extrapolated else text


def _print_table(title: str, header: list[str], lines: list[list[str]]) -> None:
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


def _bench(args: argparse.Namespace) -> int:
    from rlops.cli.bench import bench_advantages, ratio, tensor_bytes

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("rlops bench: error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1):
        print("rlops bench: error: --gamma and --lam must lie in [0, 1]", file=sys.stderr)
        return 2
    seq_lens = [256, 2048] if args.quick else args.seq_len
    repeats = 3 if args.quick else args.repeats
    dtype = _DTYPES[args.dtype]
    print(
        f"GAE, B={args.batch}, {args.dtype}, gamma={args.gamma}, lam={args.lam}, "
        f"device={device}, torch threads={torch.get_num_threads()}"
    )
    rows = bench_advantages(
        args.batch,
        seq_lens,
        dtype=dtype,
        device=device,
        gamma=args.gamma,
        lam=args.lam,
        repeats=repeats,
    )
    verdicts = []
    for t_len in seq_lens:
        shape = f"{args.batch}x{t_len}"
        by = {r.method: r for r in rows if r.shape == shape}
        ours = by["rlops auto"].seconds
        unit = tensor_bytes(args.batch, t_len, dtype)
        lines = []
        for r in by.values():
            peak = "" if r.peak_bytes is None else f"{r.peak_bytes / unit:.2f}"
            lines.append(
                [
                    r.method,
                    _fmt_ms(r.seconds, r.extrapolated),
                    f"{ratio(r.seconds, ours):.2f}",
                    peak,
                ]
            )
        _print_table(
            f"GAE [{shape}]",
            ["method", "median ms", "time / rlops auto", "peak extra ([B,T] tensors)"],
            lines,
        )
        loop, chunk, floor = by["per-token loop"], by["chunk loop (C=256)"], by["memory floor"]
        verdicts.append(
            f"[{shape}] rlops {ours * 1e3:.3f} ms: {ratio(loop.seconds, ours):,.0f}x faster than "
            f"the per-token loop{' (extrapolated)' if loop.extrapolated else ''}, "
            f"{ratio(chunk.seconds, ours):.1f}x faster than the chunk loop, "
            f"{ratio(ours, floor.seconds):.2f}x the memory floor."
        )
    print("\n".join(verdicts))
    if args.json:
        payload = {
            "command": "bench",
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "rows": [dataclasses.asdict(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
