"""``rlops bench``: on your shapes and machine, rlops beside the implementations it replaces.

The options, the run (one table per case and shape, printed as each section completes), the
closing verdict in plain words, and the optional JSON and plot. What is measured, and how, is
in :mod:`rlops.cli.bench_sections`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict

import torch

from rlops.cli import bench_sections, options
from rlops.cli.display import Progress, fmt_mib, fmt_ms, print_table, say
from rlops.cli.options import positive_int

__all__ = ["DEFAULTS", "QUICK", "SECTIONS", "add_arguments", "plot_rows", "run", "verdicts"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SECTIONS = ("advantages", "group", "logprobs")
# Sizes without --quick and with it; an option given explicitly wins over both.
DEFAULTS = dict(
    seq_len=[4096, 32768, 131072],
    logprob_tokens=[1024, 4096],
    vocab=32000,
    hidden=512,
    group_batch=256,
    repeats=10,
)
QUICK = dict(
    seq_len=[256, 2048], logprob_tokens=[256], vocab=4096, hidden=64, group_batch=64, repeats=3
)


def _sizes(name: str) -> str:
    """``(default ...; --quick: ...)`` for a size option's help."""

    def text(v) -> str:
        return " ".join(map(str, v)) if isinstance(v, list) else str(v)

    return f"(default {text(DEFAULTS[name])}; --quick: {text(QUICK[name])})"


def add_arguments(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "bench",
        help="time rlops against the loops it replaces, on your shapes",
        description="Time rlops beside the implementations it replaces (per-token and "
        "chunk loops for GAE and returns, per-sample loops for group estimators, log_softmax "
        "for log-probs, materialised logits and a top-p keep mask for the output layer), side "
        "by side in one run, and say in plain words what it buys.",
    )
    p.add_argument("--batch", metavar="B", type=positive_int, default=8, help="rows (default 8)")
    p.add_argument(
        "--seq-len",
        metavar="T",
        type=positive_int,
        nargs="+",
        help=f"sequence lengths T for the advantages {_sizes('seq_len')}",
    )
    p.add_argument(
        "--vocab", metavar="V", type=positive_int, help=f"vocabulary size {_sizes('vocab')}"
    )
    p.add_argument(
        "--logprob-tokens",
        metavar="N",
        type=positive_int,
        nargs="+",
        help=f"token counts for the log-prob section {_sizes('logprob_tokens')}",
    )
    p.add_argument(
        "--hidden",
        metavar="H",
        type=positive_int,
        help="hidden size of the output-layer rows of the log-prob section (materialised "
        f"logits vs the fused linear op) {_sizes('hidden')}",
    )
    p.add_argument(
        "--top-p",
        metavar="P",
        type=options.top_p,
        default=0.9,
        help="top-p of the log-prob section's sampler rows (a keep mask vs the fused linear op "
        "with top_p) (default 0.9)",
    )
    p.add_argument(
        "--group-batch",
        metavar="N",
        type=positive_int,
        help="samples for the group estimators, in groups of 8, at T = the smallest --seq-len "
        + _sizes("group_batch"),
    )
    p.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="which sections to run (default: all)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="dtype of the rewards and values in the advantages section (default float32)",
    )
    options.add_device(p)
    p.add_argument("--gamma", type=float, default=1.0, help="discount, in [0, 1] (default 1.0)")
    p.add_argument("--lam", type=float, default=0.95, help="GAE lambda, in [0, 1] (default 0.95)")
    p.add_argument(
        "--repeats",
        metavar="N",
        type=positive_int,
        help=f"timed runs per method {_sizes('repeats')}",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller default sizes, seconds in all (options given explicitly still apply)",
    )
    options.add_outputs(
        p, json="also write the measurements as JSON", plot="also draw time vs size as a PNG"
    )
    return p


def run(args: argparse.Namespace) -> int:
    """``rlops bench``: measure the chosen sections, print a table per case and shape as each
    section completes, then the verdict; optionally write the JSON and the plot."""
    from rlops.cli.measure import keep_freed_memory

    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1):
        print("rlops bench: error: --gamma and --lam must lie in [0, 1]", file=sys.stderr)
        return 2
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    tuned = keep_freed_memory()
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    say(
        f"rlops bench: B={args.batch}, T={args.seq_len}, {args.dtype}, gamma={args.gamma}, "
        f"lam={args.lam}, device={dev}, torch threads={torch.get_num_threads()}"
        + (", malloc keeps freed memory" if tuned else "")
    )
    rows: list[bench_sections.Row] = []
    steps = (
        len(args.seq_len) * ("advantages" in args.sections)
        + len(args.logprob_tokens) * ("logprobs" in args.sections)
        + ("group" in args.sections)
    )
    with Progress(steps) as progress:
        for section in (s for s in SECTIONS if s in args.sections):
            if section == "advantages":
                new = bench_sections.bench_advantages(
                    args.batch,
                    args.seq_len,
                    dtype=dtype,
                    device=dev,
                    gamma=args.gamma,
                    lam=args.lam,
                    repeats=args.repeats,
                    progress=progress.update,
                )
            elif section == "group":
                new = bench_sections.bench_group(
                    args.group_batch, min(args.seq_len), device=dev, repeats=args.repeats
                )
                progress.update()
            else:
                new = bench_sections.bench_logprobs(
                    args.logprob_tokens,
                    args.vocab,
                    hidden=args.hidden,
                    top_p=args.top_p,
                    device=dev,
                    progress=progress.update,
                )
            print_rows(new, args.batch, dtype)
            rows += new
    say("", "Verdict:", *verdicts(rows))
    if args.json:
        payload = {
            "command": "bench",
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "rows": [dataclasses.asdict(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        say(f"measurements written to {args.json}")
    if args.plot:
        plot_rows(rows, args.plot)
        say(f"plot written to {args.plot}")
    return 0


def print_rows(rows: list, batch: int, dtype: torch.dtype) -> None:
    """One table per (case, shape): median time, time over rlops', peak extra memory."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    keys = list(dict.fromkeys((r.section, r.case, r.shape) for r in rows))
    for section, case, shape in keys:
        group = [r for r in rows if (r.section, r.case, r.shape) == (section, case, shape)]
        ours = next((r for r in group if r.ours), group[-1])
        lines = []
        for r in group:
            peak = "" if r.peak_bytes is None else fmt_mib(r.peak_bytes)
            if section != "logprobs" and r.peak_bytes is not None:
                peak += f" ({r.peak_bytes / (batch * r.size * itemsize):.2f} x [B,T])"
            ms = ("~" if r.extrapolated else "") + fmt_ms(r.seconds)
            lines.append([r.method, ms, f"{r.seconds / ours.seconds:,.2f}", peak])
        print_table(
            f"{case} [{shape}]", ["method", "median ms", "time / rlops", "peak extra MiB"], lines
        )


def _times(x: float) -> str:
    return f"{x:,.0f}x" if x >= 10 else f"{x:.1f}x"


def verdicts(rows) -> list[str]:
    """One line per case at its largest size: each baseline's ``X ms -> Y ms (Z x)``; for
    advantages, how close rlops is to the memory floor; for log-probs, the memory too."""
    out = []
    by_case = defaultdict(list)
    for r in rows:
        by_case[(r.section, r.case)].append(r)
    for (section, case), group in by_case.items():
        size = max(r.size for r in group)
        at = [r for r in group if r.size == size]
        ours = next(r for r in at if r.ours)
        if section == "logprobs":
            base = next(r for r in at if not r.ours)
            mem = ""
            if base.peak_bytes and ours.peak_bytes is not None:
                mem = (
                    f"; peak extra memory {fmt_mib(base.peak_bytes)} MiB -> "
                    f"{fmt_mib(ours.peak_bytes)} MiB ({ours.peak_bytes / base.peak_bytes:.2f}x)"
                )
            speed = base.seconds / ours.seconds
            how = f"{speed:.1f}x faster" if speed >= 1 else f"{1 / speed:.1f}x slower"
            out.append(
                f"- {case} [{ours.shape}], forward + backward: {fmt_ms(base.seconds)} ms -> "
                f"{fmt_ms(ours.seconds)} ms ({how}){mem}."
            )
            continue
        parts = [
            f"{r.method} {fmt_ms(r.seconds)} ms{' (extrapolated)' if r.extrapolated else ''} -> "
            f"{fmt_ms(ours.seconds)} ms ({_times(r.seconds / ours.seconds)})"
            for r in at
            if not (r.ours or r.method.startswith("rlops") or r.method == "memory floor")
        ]
        line = f"- {case} [{ours.shape}]: " + "; ".join(parts) + "."
        floor = next((r for r in at if r.method == "memory floor"), None)
        if floor is not None:
            line += f" rlops runs at {ours.seconds / floor.seconds:.1f}x the memory floor."
        out.append(line)
    return out


def plot_rows(rows, path: str) -> None:
    """One panel per section: time vs size, log-log, where a section has several sizes (hollow
    markers: extrapolated); bars from zero where it has one. Legends below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = list(dict.fromkeys(r.section for r in rows))
    fig, axes = plt.subplots(1, len(sections), figsize=(6 * len(sections), 4.5), squeeze=False)
    xlabel = {"advantages": "T (tokens per row)", "group": "T", "logprobs": "tokens"}
    for ax, section in zip(axes[0], sections):
        mine = [r for r in rows if r.section == section]
        if len({r.size for r in mine}) == 1:
            _bars(ax, mine)
            ax.set_title(f"{section} [{mine[0].shape}]")
        else:
            _lines(ax, mine)
            ax.set_xlabel(xlabel.get(section, "size"))
            ax.set_title(section)
        ax.set_ylabel("median time (ms)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _lines(ax, rows) -> None:
    lines = defaultdict(list)
    for r in rows:
        lines[f"{r.case}: {r.method}"].append(r)
    for label, pts in lines.items():
        pts.sort(key=lambda r: r.size)
        ms = [r.seconds * 1e3 for r in pts]
        width = 2 if pts[0].ours else 1
        (line,) = ax.plot([r.size for r in pts], ms, marker="o", label=label, lw=width)
        hollow = [(r.size, r.seconds * 1e3) for r in pts if r.extrapolated]
        if hollow:
            ax.plot(*zip(*hollow), ls="", marker="o", mfc="white", color=line.get_color())
    sizes = sorted({r.size for r in rows})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)


def _bars(ax, rows) -> None:
    cases = list(dict.fromkeys(r.case for r in rows))
    methods = list(dict.fromkeys(r.method for r in rows))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        pts = [
            (i, r) for i, c in enumerate(cases) for r in rows if (r.case, r.method) == (c, method)
        ]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i, _ in pts]
        bars = ax.bar(xs, [r.seconds * 1e3 for _, r in pts], width, label=method)
        ax.bar_label(bars, [f"{fmt_ms(r.seconds)} ms" for _, r in pts], fontsize=7)
    ax.set_xticks(range(len(cases)), cases)
    ax.margins(y=0.12)
    ax.grid(True, axis="y", alpha=0.3)
