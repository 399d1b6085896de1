"""``rlops bench``: on your shapes and machine, rlops beside the implementations it replaces.

The options, the run (one table per case and shape, printed as each section completes, with a
warning where a figure cannot be right), the closing verdict in plain words (each method at its
own faster thread count; for log-probs, where rlops pays off), and the optional JSON and plot.
What is measured, and how, is :mod:`rlops.measure.sections`; the plot, :mod:`rlops.measure.plot`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict

import torch

from rlops.cli.display import Progress, fmt_mib, fmt_ms, json_config, print_table, say, wrap
from rlops.measure import options, sections
from rlops.measure.options import positive_int
from rlops.measure.plot import plot_rows
from rlops.measure.sections import FLOOR, Row
from rlops.measure.timing import keep_freed_memory, torch_threads

__all__ = [
    "DEFAULTS",
    "FULL",
    "QUICK",
    "SECTIONS",
    "add_arguments",
    "pays_off",
    "plot_rows",
    "run",
    "tables",
    "verdicts",
    "warnings",
]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SECTIONS = ("advantages", "group", "logprobs", "agentic", "distillation")
# Sizes by default, with --quick and with --full; an option given explicitly wins over them.
# slow_limit_s: a baseline that would take longer at full length is extrapolated from T = 1024.
_PRESETS = {  # setting: (default, --quick, --full)
    "seq_len": ([2048, 32768], [256, 2048], [4096, 32768, 131072]),
    "logprob_tokens": ([2048], [256], [1024, 4096]),
    "vocab": (32000, 4096, 32000),
    "hidden": (256, 64, 512),
    "group_batch": (256, 64, 256),
    "repeats": (5, 3, 10),
    "slow_limit_s": (1.0, 0.5, 10.0),
}
DEFAULTS, QUICK, FULL = ({name: v[i] for name, v in _PRESETS.items()} for i in range(3))
MOVES = 2.0  # a ratio to rlops that moves more than this between thread counts is flagged
SAME_TIME = 1.15  # times within 15% of each other read "about as fast" in the verdict
LEANER = 0.9  # a peak below 0.9x the baseline's is a memory saving in the verdict
WORTH = 0.5  # a slower rlops path pays off where memory binds if it at least halves the peak


def _sizes(name: str) -> str:
    """``(default ...; --quick: ...; --full: ...)`` for a size option's help."""

    def text(v) -> str:
        return " ".join(map(str, v)) if isinstance(v, list) else str(v)

    default, quick, full = map(text, _PRESETS[name])
    return f"(default {default}; --quick: {quick}; --full: {full})"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rlops bench``'s options, on its parser ``p``."""
    p.add_argument("--batch", metavar="B", type=positive_int, default=8, help="rows (default 8)")
    for flag, metavar, many, text in (
        ("--seq-len", "T", True, "sequence lengths T for the advantages"),
        ("--vocab", "V", False, "vocabulary size"),
        ("--logprob-tokens", "N", True, "token counts for the log-prob, agentic and "
         "distillation sections"),
        ("--hidden", "H", False, "hidden size of the output-layer rows of those sections "
         "(materialised logits vs the fused linear ops)"),
        ("--group-batch", "N", False, "samples for the group estimators, in groups of 8, at "
         "T = the smallest --seq-len"),
        ("--repeats", "N", False, "timed runs per method and thread count"),
    ):  # fmt: skip
        name = flag[2:].replace("-", "_")
        nargs = "+" if many else None
        p.add_argument(
            flag, metavar=metavar, type=positive_int, nargs=nargs, help=f"{text} {_sizes(name)}"
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
    options.add_threads(
        p, "every method is also timed at 1 thread, and each compared at its faster count"
    )
    p.add_argument("--gamma", type=float, default=1.0, help="discount, in [0, 1] (default 1.0)")
    p.add_argument("--lam", type=float, default=0.95, help="GAE lambda, in [0, 1] (default 0.95)")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="smaller default sizes, under a minute (options given explicitly still apply)",
    )
    size.add_argument(
        "--full",
        action="store_true",
        help="the larger grid (T up to 131072, 4096 log-prob tokens at H = 512; several minutes)",
    )
    options.add_outputs(
        p, json="also write the measurements as JSON", plot="also draw time vs size"
    )


def plan(args: argparse.Namespace) -> list[tuple[str, float]]:
    """The steps of a run, in order, each with a rough cost (seconds on 2 idle cores, from one
    run's proportions): what the progress line scales its estimate of the time left by."""
    counts = len(sections.thread_counts(args.device, args.threads))
    lim = args.slow_limit_s

    def loop(per_token: float, t: int) -> float:  # the probe at T = 1024, then T unless slow
        full = per_token * t
        return per_token * 1024 + (0.0 if full > lim else full if full > 1 else 4 * full)

    steps = []
    if "advantages" in args.sections:
        for t in args.seq_len:  # the two token loops dominate
            steps.append((f"advantages T={t}", 0.3 + counts * (loop(4e-5, t) + loop(1.2e-4, t))))
    if "group" in args.sections:
        steps.append(("group", 0.3 + 2e-4 * args.group_batch))
    # a case of two variants: three fresh processes (the memory of each, then their times)
    runs = 2 + counts * 3  # per variant: memory, warm-up, then the timed runs at each count
    if "logprobs" in args.sections:
        for n in args.logprob_tokens:
            elements = n * args.vocab * runs
            linear = 4e-10 * elements * args.hidden
            steps.append((f"logprobs N={n}: over logits", 6 + 4e-8 * elements))
            steps.append((f"logprobs N={n}: output layer", 6 + linear))
            steps.append((f"logprobs N={n}: top-p output layer", 6 + linear + 2e-7 * elements))
            steps.append((f"logprobs N={n}: PPO loss phase", 6 + 1.5 * linear))
    if "agentic" in args.sections:
        for n in args.logprob_tokens:
            linear = 4e-10 * n * args.vocab * args.hidden * runs
            steps.append((f"agentic N={n}: row mask", 6 + linear))
            steps.append((f"agentic N={n}: kept ids", 6 + 2 * linear))
    if "distillation" in args.sections:
        for n in args.logprob_tokens:  # four variants, then three
            linear = 4e-10 * n * args.vocab * args.hidden * runs
            steps.append((f"distillation N={n}: top-k forward KL", 9 + 3 * linear))
            steps.append((f"distillation N={n}: with the tail", 7 + 2.2 * linear))
    if steps:  # the first step also pays for first calls (numba's cache, thread pools)
        steps[0] = (steps[0][0], steps[0][1] + 2.0)
    return steps


def run(args: argparse.Namespace) -> int:
    """``rlops bench``: measure the chosen sections, print a table per case and shape as each
    section completes, then the verdict; optionally write the JSON and the plot."""
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1):
        print("rlops bench: error: --gamma and --lam must lie in [0, 1]", file=sys.stderr)
        return 2
    preset = QUICK if args.quick else FULL if args.full else DEFAULTS
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    with torch_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    tuned = keep_freed_memory()
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    counts = sections.thread_counts(dev, args.threads)
    say(
        f"rlops bench: B={args.batch}, T={args.seq_len}, {args.dtype}, gamma={args.gamma}, "
        f"lam={args.lam}, device={dev}, torch threads={torch.get_num_threads()}"
        + (", malloc keeps freed memory" if tuned else ""),
        *wrap(
            "Methods compared are timed interleaved (each repeat calls every one in turn), at "
            + " and ".join(map(_threads, counts))
            + ("; time / rlops compares each at its own faster count." if len(counts) > 1 else ".")
        ),
    )
    rows: list[Row] = []
    found: list[str] = []
    common = dict(device=dev, repeats=args.repeats, threads=args.threads)
    with Progress(plan(args), "rlops bench") as progress:
        for section in (s for s in SECTIONS if s in args.sections):
            if section == "advantages":
                new = sections.bench_advantages(
                    args.batch,
                    args.seq_len,
                    dtype=dtype,
                    gamma=args.gamma,
                    lam=args.lam,
                    slow_limit_s=args.slow_limit_s,
                    progress=progress.update,
                    **common,
                )
            elif section == "group":
                new = sections.bench_group(args.group_batch, min(args.seq_len), **common)
                progress.update()
            elif section in ("agentic", "distillation"):
                measure = getattr(sections, f"bench_{section}")
                new = measure(
                    args.logprob_tokens,
                    args.vocab,
                    hidden=args.hidden,
                    progress=progress.update,
                    **{**common, "repeats": 3},
                )
            else:
                new = sections.bench_logprobs(
                    args.logprob_tokens,
                    args.vocab,
                    hidden=args.hidden,
                    top_p=args.top_p,
                    progress=progress.update,
                    **{**common, "repeats": 3},
                )
            found += print_rows(new, counts)
            rows += new
    verdict = verdicts(rows)
    wall_s = time.perf_counter() - start
    say("", "Verdict:", *(part for line in verdict for part in wrap(line)))
    say(f"{len(tables(rows))} tables, {wall_s:.1f} s of wall time")
    if args.json:
        payload = {
            "command": "bench",
            "config": json_config(args),
            "thread_counts": list(counts),
            "timing": "interleaved: each repeat times every method of a comparison in turn; "
            "seconds: each method at its own fastest thread count (threads)",
            "rows": [dataclasses.asdict(r) for r in rows],
            "warnings": found,
            "verdict": verdict,
            "wall_s": wall_s,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        say(f"measurements written to {args.json}")
    if args.plot:
        plot_rows(rows, args.plot)
        say(f"plot written to {args.plot}")
    return 0


def warnings(rows: list[Row]) -> list[str]:
    """What cannot be right in one table (one case at one shape): a memory floor slower than a
    method it bounds, or a method whose time over rlops' moves more than 2x between thread
    counts (a thread stall: the comparison then rests on each one's faster count)."""
    out = []
    floor = next((r for r in rows if r.method == FLOOR), None)
    bounded = [r for r in rows if r is not floor and not r.extrapolated]
    if floor is not None and bounded:
        fastest = min(bounded, key=lambda r: r.seconds)
        if floor.seconds > fastest.seconds:
            out.append(
                f"the {FLOOR} ({fmt_ms(floor.seconds)} ms) is slower than {fastest.method} "
                f"({fmt_ms(fastest.seconds)} ms), which it bounds: the cores were busy"
            )
    ours = next((r for r in rows if r.ours), None)
    for r in rows:
        if ours is None or r is ours:
            continue
        both = sorted(n for n in r.times if n in ours.times)
        if len(both) < 2:
            continue
        ratio = {n: r.times[n] / ours.times[n] for n in both}
        if max(ratio.values()) > MOVES * min(ratio.values()):
            at = " and ".join(f"{ratio[n]:,.2f} at {_threads(n)}" for n in both)
            out.append(
                f"{r.method} / rlops moves more than {MOVES:g}x between thread counts: {at} "
                "(a thread stall in one of the two; see their times)"
            )
    return out


def _threads(n: int | None) -> str:
    return f"{n} thread{'s' * (n != 1)}"


def print_rows(rows: list[Row], counts: tuple[int, ...]) -> list[str]:
    """One table per (case, shape): median time at each thread count, the count each method is
    compared at (its faster), time over rlops', peak extra memory, and its warnings under it.
    Returns the warnings, each after its table's title."""
    found = []
    for title, group in tables(rows).items():
        ours = next((r for r in group if r.ours), group[-1])
        lines = []
        for r in group:
            peak = "" if r.peak_bytes is None else fmt_mib(r.peak_bytes)
            if r.unit_bytes and r.peak_bytes is not None:
                peak += f" ({r.peak_bytes / r.unit_bytes:.2f} x [B,T])"
            ms = [("~" if r.extrapolated else "") + fmt_ms(r.times[n]) for n in counts]
            best = [_threads(r.threads)] if len(counts) > 1 else []
            lines.append([r.method, *ms, *best, f"{r.seconds / ours.seconds:,.2f}", peak])
        notes = warnings(group)
        found += [f"{title}: {w}" for w in notes]
        header = ["method", *(f"ms, {_threads(n)}" for n in counts)]
        header += ["fastest at"] if len(counts) > 1 else []
        print_table(
            title,
            [*header, "time / rlops", "peak extra MiB"],
            lines,
            caption="\n".join(f"warning: {w}" for w in notes) or None,
        )
    return found


def tables(rows: list[Row]) -> dict[str, list[Row]]:
    """The rows of each table, by its title ``case [shape]``, in the order they are printed."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(f"{r.case} [{r.shape}]", []).append(r)
    return out


def _speed(base: float, ours: float) -> str:
    x = base / ours
    if 1 / SAME_TIME <= x <= SAME_TIME:
        return f"about as fast: {1 / x:.2f}x slower" if x < 1 else f"about as fast: {x:.2f}x faster"
    if x < 1:
        return f"{1 / x:.1f}x slower"
    return f"{x:,.0f}x faster" if x >= 10 else f"{x:.1f}x faster"


def _ms(r: Row) -> str:
    """A row's compared time, with its thread count where it was timed at several."""
    at = f" at {_threads(r.threads)}" if r.threads is not None and len(r.times) > 1 else ""
    return f"{fmt_ms(r.seconds)} ms{at}{' (extrapolated)' if r.extrapolated else ''}"


def pays_off(time_x: float, memory_x: float | None) -> str:
    """The verdict's judgement of a log-prob case from rlops' time over the baseline's
    (``time_x``, above 1: slower) and its peak memory over the baseline's (``memory_x``; None:
    not measured). Times within ``SAME_TIME`` of each other are as fast; a peak below
    ``LEANER`` times the baseline's is a saving, worth more time where it is at most ``WORTH``
    times the baseline's (a small saving for more time does not pay off at that shape)."""
    faster, slower = time_x < 1 / SAME_TIME, time_x > SAME_TIME
    leaner = memory_x is not None and memory_x < LEANER
    heavier = memory_x is not None and memory_x > 1 / LEANER
    grows = "the saving grows with N x V"
    if slower and memory_x is not None and memory_x <= WORTH:
        return (
            f"rlops trades time for memory: it pays off where memory binds ({grows}), not "
            "where memory is plentiful and time matters."
        )
    if faster and leaner:
        return "rlops pays off in time and in memory."
    if faster:
        return "rlops pays off in time" + (", at more memory." if heavier else ".")
    if leaner and not slower:
        return "rlops pays off in memory, at no cost in time."
    return (
        "rlops does not pay off at this shape"
        + ("" if memory_x is None else f"; {grows} (raise --logprob-tokens or --vocab)")
        + "."
    )


def verdicts(rows: list[Row]) -> list[str]:
    """One line per case at its largest size, each method at its own fastest thread count.
    Advantages and group: each baseline's ``X ms -> Y ms (Z x faster)`` (or slower, or about
    as fast), and how close rlops is to the memory floor. Log-probs: time and peak memory
    before and after, and in words where rlops pays off (:func:`pays_off`)."""
    out = []
    by_case = defaultdict(list)
    for r in rows:
        by_case[(r.section, r.case)].append(r)
    for (section, case), group in by_case.items():
        size = max(r.size for r in group)
        at = [r for r in group if r.size == size]
        ours = next(r for r in at if r.ours)
        if section in ("logprobs", "agentic", "distillation"):
            base = next(r for r in at if not r.ours)
            line = (
                f"- {case} [{ours.shape}], forward + backward: {_ms(base)} -> {_ms(ours)} "
                f"({_speed(base.seconds, ours.seconds)})"
            )
            memory_x = None
            if base.peak_bytes and ours.peak_bytes is not None:
                memory_x = ours.peak_bytes / base.peak_bytes
                line += (
                    f"; peak extra memory {fmt_mib(base.peak_bytes)} MiB -> "
                    f"{fmt_mib(ours.peak_bytes)} MiB ({memory_x:.2f}x)"
                )
            out.append(f"{line}. {pays_off(ours.seconds / base.seconds, memory_x)}")
            continue
        parts = [
            f"{r.method} {_ms(r)} -> {_ms(ours)} ({_speed(r.seconds, ours.seconds)})"
            for r in at
            if not (r.ours or r.method.startswith("rlops") or r.method == FLOOR)
        ]
        line = f"- {case} [{ours.shape}]: " + "; ".join(parts) + "."
        floor = next((r for r in at if r.method == FLOOR), None)
        if floor is not None and floor.seconds <= ours.seconds:
            line += f" rlops runs at {ours.seconds / floor.seconds:.1f}x the memory floor."
        elif floor is not None:
            line += " The memory floor measured slower than rlops (see the table's warning)."
        out.append(line)
    return out
