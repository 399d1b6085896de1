"""``rlops profile``: one PPO training step, stage by stage, naive implementations beside rlops.

What runs in each stage is :mod:`rlops.measure.ppo`; this module holds the options, the table
(time, share and peak memory per stage), the verdict in plain words and the plot. With the
fused-linear head the LM head moves from the forward into the log-prob stage: the two are then
compared as one span (``forward + log-prob + entropy``), so neither is credited for the move.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from rlops.cli.display import Progress, fmt_mib, fmt_ms, json_config, print_table, say, wrap
from rlops.cli.model import ModelConfig, TinyTransformer
from rlops.measure import options
from rlops.measure.options import positive_int
from rlops.measure.ppo import (
    HEADS,
    IMPLS,
    OUTPUT,
    STAGES,
    make_batch,
    ppo_step,
    profile_step,
    profile_whole_step,
)
from rlops.measure.timing import torch_threads

__all__ = [
    "HEADS",
    "IMPLS",
    "OUTPUT",
    "STAGES",
    "add_arguments",
    "make_batch",
    "ppo_step",
    "profile_step",
    "run",
    "same_code",
    "verdict",
]

SAME_CODE = ("forward", "value head")  # both run the same code here (forward: rlops head logits)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rlops profile``'s options, on its parser ``p``."""
    for name, metavar, default, text in (
        ("batch", "B", 2, "rows"),
        ("seq-len", "T", 1024, "tokens per row"),
        ("vocab", "V", 16384, "vocabulary size"),
        ("layers", "N", 2, "transformer blocks"),
        ("d-model", "D", 128, "model width"),
        ("heads", "N", 4, "attention heads"),
        ("repeats", "N", 5, "timed steps per implementation"),
    ):
        p.add_argument(
            f"--{name}",
            metavar=metavar,
            type=positive_int,
            default=default,
            help=f"{text} (default {default})",
        )
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default="float32",
        help="model and logits dtype (default float32)",
    )
    p.add_argument(
        "--rlops-head",
        choices=HEADS,
        default=HEADS[0],
        help="how the rlops step computes the log-probs from the final hidden states: "
        "fused-linear (the LM head inside linear_logprobs_and_entropy, no [B, T, V] logits) "
        "or logits (materialised, as naive, then logprobs_and_entropy) (default fused-linear)",
    )
    p.add_argument(
        "--top-p",
        metavar="P",
        type=options.top_p,
        help="replay a top-p sampler's support: naive builds a [B, T, V] keep mask (sort, "
        "cumsum, scatter), rlops passes top_p to the fused op (default: none, the full "
        "softmax)",
    )
    options.add_device(p)
    options.add_threads(p, "1 gives steadier numbers on a machine whose cores are busy")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    options.add_outputs(
        p,
        json="also write the measurements as JSON",
        plot="save time and memory per stage as a PNG",
    )


def _check(args: argparse.Namespace) -> str | None:
    """An error message for options that parse but cannot run together, else None."""
    if args.seq_len < 2:
        return f"--seq-len must be at least 2, got {args.seq_len}"
    if args.vocab < 2:
        return f"--vocab must be at least 2, got {args.vocab}"
    if args.d_model % args.heads:
        return f"--d-model {args.d_model} is not a multiple of --heads {args.heads}"
    return None


HEADER = ["stage", "naive ms", "%", "rlops ms", "%", "speed-up", "naive MiB", "rlops MiB"]
CAPTION = "MiB: most memory a stage held beyond what was live at its start"


def same_code(head: str) -> tuple[str, ...]:
    """The stages both implementations run with the same code, for an rlops ``head``."""
    return SAME_CODE if head == "logits" else tuple(s for s in SAME_CODE if s != "forward")


def _merged(result: dict, same: tuple[str, ...]) -> bool:
    """Whether the forward and the log-prob stages are compared as one span: the LM head moved
    from one to the other (the forward is not the same code) and the span was measured."""
    return "forward" not in same and OUTPUT in result["naive"]


def _rows(result: dict, step_peak: dict, same: tuple[str, ...] = SAME_CODE) -> list[list[str]]:
    totals = {i: sum(result[i][s]["seconds"] for s in STAGES) for i in IMPLS}
    merged = _merged(result, same)
    stages = [*STAGES[:2], OUTPUT, *STAGES[2:]] if merged else STAGES
    rows = []
    for s in stages:
        n, r = result["naive"][s], result["rlops"][s]
        speed = f"{n['seconds'] / r['seconds']:.2f}x"
        if s in same or (merged and s in STAGES[:2]):
            speed = "same code" if s in same else "head moved"
        rows.append(
            [
                s,
                fmt_ms(n["seconds"]),
                f"{100 * n['seconds'] / totals['naive']:.1f}%",
                fmt_ms(r["seconds"]),
                f"{100 * r['seconds'] / totals['rlops']:.1f}%",
                speed,
                fmt_mib(n["peak_bytes"]),
                fmt_mib(r["peak_bytes"]),
            ]
        )
    rows.append(
        [
            "whole step",
            fmt_ms(totals["naive"]),
            "100%",
            fmt_ms(totals["rlops"]),
            "100%",
            f"{totals['naive'] / totals['rlops']:.2f}x",
            fmt_mib(step_peak["naive"]),
            fmt_mib(step_peak["rlops"]),
        ]
    )
    return rows


def verdict(result: dict, step_peak: dict, same: tuple[str, ...] = SAME_CODE) -> str:
    """Plain words: the step before and after, the stage that gained most time (in ms) and the
    one that gained most memory (in MiB), and what dominates the step with rlops. Where the LM
    head moved into the log-prob stage, the forward and that stage count as one span."""
    totals = {i: sum(result[i][s]["seconds"] for s in STAGES) for i in IMPLS}
    differ = [s for s in STAGES if s not in same]
    if _merged(result, same):
        differ = [OUTPUT, *(s for s in differ if s not in STAGES[:2])]

    def saved(s: str, key: str) -> float:
        return (result["naive"][s][key] or 0) - (result["rlops"][s][key] or 0)

    def change(s: str, key: str) -> str:
        n, r = result["naive"][s][key], result["rlops"][s][key]
        if key == "seconds":
            return f"{fmt_ms(n)} -> {fmt_ms(r)} ms"
        return f"peak {fmt_mib(n)} -> {fmt_mib(r)} MiB"

    lines = [
        f"One PPO step: {fmt_ms(totals['naive'])} ms -> {fmt_ms(totals['rlops'])} ms "
        f"({totals['naive'] / totals['rlops']:.2f}x); peak memory "
        f"{fmt_mib(step_peak['naive'])} -> {fmt_mib(step_peak['rlops'])} MiB.",
    ]
    best = {
        key: max(differ, key=functools.partial(saved, key=key)) for key in ("seconds", "peak_bytes")
    }
    gains = [(key, s) for key, s in best.items() if saved(s, key) > 0]
    if len(gains) == 2 and best["seconds"] == best["peak_bytes"]:
        s = best["seconds"]
        lines.append(
            f"Largest time and memory gain: {s}, {change(s, 'seconds')}, {change(s, 'peak_bytes')}."
        )
    else:
        for key, s in gains:
            label = "time" if key == "seconds" else "memory"
            lines.append(f"Largest {label} gain: {s}, {change(s, key)}.")
    if not gains:
        lines.append("No stage takes less time or memory with rlops at this size.")
    top = sorted(STAGES, key=lambda s: -result["rlops"][s]["seconds"])[:2]
    shares = ", ".join(
        f"{s} {100 * result['rlops'][s]['seconds'] / totals['rlops']:.0f}%" for s in top
    )
    lines.append(f"With rlops the step is dominated by {shares}.")
    return "\n".join(lines)


def save_plot(result: dict, step_peak: dict, title: str, path: str) -> None:
    """Time per stage (stacked bars) and peak memory per stage (grouped bars) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=120)
    colors = [f"C{k}" for k in range(len(STAGES))]  # the default colour cycle
    for y, impl in enumerate(IMPLS):
        left = 0.0
        for k, s in enumerate(STAGES):
            ms = 1e3 * result[impl][s]["seconds"]
            ax_t.barh(y, ms, left=left, color=colors[k], label=s if y == 0 else None)
            left += ms
    ax_t.set_yticks(range(len(IMPLS)), IMPLS)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("time per step (ms)")
    ax_t.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    width = 0.4
    for j, impl in enumerate(IMPLS):
        mib = [(result[impl][s]["peak_bytes"] or 0) / 2**20 for s in STAGES]
        ax_m.bar([i + (j - 0.5) * width for i in range(len(STAGES))], mib, width, label=impl)
    ax_m.set_xticks(range(len(STAGES)), STAGES, rotation=20, ha="right", fontsize=8)
    ax_m.set_ylabel("peak memory of the stage (MiB)")
    ax_m.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """``rlops profile``: measure, print the table and the verdict, optionally plot / JSON."""
    error = _check(args)
    if error is not None:
        print(f"rlops profile: error: {error}", file=sys.stderr)
        return 2
    with torch_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = ModelConfig(
        vocab=args.vocab,
        context=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
    )
    model = TinyTransformer(cfg).to(device=device, dtype=dtype)
    data = make_batch(cfg, args.batch, args.seq_len, device, gen)
    step_kw = {"head": args.rlops_head, "top_p": args.top_p}
    sampler = "" if args.top_p is None else f", top-p {args.top_p}"
    title = (
        f"One PPO step, B={args.batch}, T={args.seq_len}, V={args.vocab}, layers={args.layers}, "
        f"d_model={args.d_model}, {args.dtype}, {device}, torch threads={torch.get_num_threads()}"
        f", rlops head: {args.rlops_head}{sampler}"
    )
    say(title)
    with Progress(2 * (args.repeats + 1), "PPO steps") as progress:
        result = profile_step(model, data, device, args.repeats, progress.update, **step_kw)
    step_peak = profile_whole_step(model, data, device, **step_kw)
    same = same_code(args.rlops_head)
    print_table(
        f"Stages of one PPO step [{args.batch}x{args.seq_len}, V={args.vocab}{sampler}]",
        HEADER,
        _rows(result, step_peak, same),
        caption=CAPTION,
        total_row=True,
    )
    say(*(part for line in verdict(result, step_peak, same).splitlines() for part in wrap(line)))
    if args.plot:
        save_plot(result, step_peak, title, args.plot)
        say(f"plot saved to {args.plot}")
    if args.json:
        payload = {
            "command": "profile",
            "config": json_config(args),
            "stages": list(STAGES),
            "results": result,
            "step_peak_bytes": step_peak,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        say(f"measurements written to {args.json}")
    return 0
